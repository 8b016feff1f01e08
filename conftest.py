"""Fixtures for tests anywhere in the repository (``tests/`` and ``plugins/*/tests``).

``plain_llama``: the tiny Llama's tokens without a connector, the reference of
every engine test that compares tokens. A test module declares the rounds it
needs as ``PLAIN_LLAMA_ROUNDS``; the rounds of every module collected run in
one engine, on first use, instead of one engine per module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from composer.testing.engine import Prompt, SharedRuns

_WANTED = pytest.StashKey["list[list[list[Prompt]]]"]()


def pytest_collection_finish(session: pytest.Session) -> None:
    wanted: list[list[list[Prompt]]] = []
    for item in session.items:
        rounds = getattr(getattr(item, "module", None), "PLAIN_LLAMA_ROUNDS", None)
        if rounds is not None and rounds not in wanted:
            wanted.append(rounds)
    session.config.stash[_WANTED] = wanted


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
