"""How the project runs ``vllm serve``: ``kvc serve`` becomes it, ``kvc bench`` starts it."""

from __future__ import annotations

import sys


def vllm_command() -> list[str]:
    """vLLM's own CLI, through a shim that also works with the CPU build's dist name
    (:mod:`composer.vllm.cli`), run by this Python."""
    return [sys.executable, "-m", "composer.vllm.cli"]
