"""``kvc``'s entry point: parse, run the command, turn errors into exit codes."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import pluggy

from composer.cli.common import (
    EXIT_ENVIRONMENT,
    EXIT_INVALID,
    CommandError,
    MissingRuntime,
    print_problems,
)
from composer.cli.logs import configure
from composer.cli.parser import build_parser
from composer.discovery import PluginConflict, PluginLoadError
from composer.errors import PipelineInvalid, escape


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A name the terminal's encoding cannot show is written as an escape, not a crash.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID
    if args.verbose or args.command in ("serve", "demo"):
        # Only commands that run plugins log; structlog's import is most of
        # `kvc validate`'s start-up, so the others never configure it.
        configure(level={0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG))
    try:
        return int(args.func(args))
    except PipelineInvalid as exc:
        print_problems(exc.problems, sys.stderr)
        return EXIT_INVALID
    except CommandError as exc:
        print(f"kvc: error: {escape(str(exc))}", file=sys.stderr)
        return EXIT_INVALID
    except (
        MissingRuntime, PluginConflict, PluginLoadError, pluggy.PluginValidationError
    ) as exc:
        print(f"kvc: error: {escape(str(exc))}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; say nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        return 130
