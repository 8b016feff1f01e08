"""Shared set-up for tests that run real vLLM: one tiny model, engines in child processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from composer.testing.engine import plugin_env
from composer.testing.tiny_model import build_tiny_model

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(build_tiny_model())


@pytest.fixture(scope="session")
def engine_env() -> dict[str, str]:
    """Environment for engine processes: the test plugins and recording connector importable."""
    return plugin_env(HERE, "plugins_for_tests")


@pytest.fixture(scope="package", autouse=True)
def _test_plugins_in_this_process() -> Iterator[None]:
    """The test plugins, for pipelines these tests validate in-process; undone after
    this package, so the other tests see only the installed plugins."""
    sys.path.insert(0, str(HERE))
    old = os.environ.get("KV_COMPOSER_PLUGIN_MODULES")
    os.environ["KV_COMPOSER_PLUGIN_MODULES"] = "plugins_for_tests"
    yield
    if old is None:
        os.environ.pop("KV_COMPOSER_PLUGIN_MODULES", None)
    else:
        os.environ["KV_COMPOSER_PLUGIN_MODULES"] = old
    sys.path.remove(str(HERE))


@pytest.fixture
def offload_pipeline(tmp_path: Path) -> Path:
    """A pipeline file with one 64 MiB offload-cpu tier saving prompts synchronously."""
    path = tmp_path / "cpu.yaml"
    path.write_text(
        "version: 1\n"
        "nodes:\n"
        "  cpu:\n"
        "    plugin: offload-cpu\n"
        "    config: {capacity: 64MiB, save: prompt, save_mode: sync}\n"
    )
    return path
