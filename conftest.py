"""Fixtures for tests anywhere in the repository (``tests/`` and ``plugins/*/tests``).

``plain_llama``: the tiny Llama's tokens without a connector, the reference of
every engine test that compares tokens. A test module declares the rounds it
needs as ``PLAIN_LLAMA_ROUNDS``; the rounds of every module collected run in
one engine, on first use, instead of one engine per module.

``figures("...")``: what a test measured (the time an outage took to resume,
the requests it cost), listed under "figures measured" in the terminal summary
with the test's id, whether the test then passes or fails: `make test` captures
output, so a printed figure would be seen only under ``-s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import structlog

if TYPE_CHECKING:
    from composer.testing.engine import Prompt, SharedRuns

_WANTED = pytest.StashKey["list[list[list[Prompt]]]"]()
_FIGURES = pytest.StashKey[list[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    wanted: list[list[list[Prompt]]] = []
    for item in session.items:
        rounds = getattr(getattr(item, "module", None), "PLAIN_LLAMA_ROUNDS", None)
        if rounds is not None and rounds not in wanted:
            wanted.append(rounds)
    session.config.stash[_WANTED] = wanted


@pytest.fixture(autouse=True)
def _structlog_as_before() -> Iterator[None]:
    """A test that runs ``kvc`` in-process configures structlog for the stderr of that
    moment, which is pytest's capture, closed after the test: the configuration of
    before comes back after each test, or a later test's first log writes to a
    closed file (``ValueError: I/O operation on closed file``)."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


@pytest.fixture(scope="session")
def plain_llama(request: pytest.FixtureRequest) -> SharedRuns:
    """``plain_llama(rounds)``: the EngineResult of ``rounds`` on the tiny Llama, no
    connector, vLLM's prefix cache off, the default EngineSpec settings with
    ``enforce_eager`` (as every engine compared with it)."""
    from composer.testing.engine import EngineSpec, SharedRuns
    from composer.testing.tiny_model import build_tiny_model

    spec = EngineSpec(
        model=str(build_tiny_model()),
        rounds=[],
        enforce_eager=True,
        in_process=True,
        # No plugin modules: the test modules' own may not be importable here.
        env={"KV_COMPOSER_PLUGIN_MODULES": ""},
        timeout_s=600,
    )
    return SharedRuns(spec, request.config.stash.get(_WANTED, []))


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    lines = request.config.stash.setdefault(_FIGURES, [])

    def add(text: str) -> None:
        lines.append(f"{request.node.nodeid}: {text}")

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = terminalreporter.config.stash.get(_FIGURES, [])
    if lines:
        terminalreporter.write_sep("-", "figures measured")
        for line in lines:
            terminalreporter.write_line(line)
