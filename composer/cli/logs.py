"""structlog set-up: a console renderer in a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys


def configure(*, json: bool | None = None, level: int = logging.INFO) -> None:
    import structlog  # lazily: it costs more than the rest of `kvc validate`

    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
