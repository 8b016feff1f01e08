"""Shared set-up for tests that run real vLLM: one tiny model, engines in child processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer.testing.tiny_model import build_tiny_model

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(build_tiny_model())


@pytest.fixture(scope="session")
def engine_env() -> dict[str, str]:
    """Environment for engine processes: the test plugins and recording connector importable."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KV_COMPOSER_PLUGIN_MODULES": "plugins_for_tests"}


@pytest.fixture(scope="session", autouse=True)
def _test_plugins_in_this_process() -> None:
    import sys

    sys.path.insert(0, str(HERE))
    os.environ["KV_COMPOSER_PLUGIN_MODULES"] = "plugins_for_tests"
