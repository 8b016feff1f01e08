"""vLLM's own test files run here (see the adapters) carry vLLM's markers."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's CI marks the tests that need no GPU; nothing here selects on it.
    config.addinivalue_line("markers", "cpu_test: vLLM's marker of tests that run without a GPU")
