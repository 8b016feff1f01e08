"""pytest plugin of the pass on vLLM's GPU release (``-p kvc_gpu_release_pass``,
from ``tests/gpu_release/run.py``).

* Refuses to run unless ``import vllm`` gives the release asked for
  (``KVC_VLLM_RELEASE``) with the CUDA platform stand-in as vLLM's platform, so
  that a wrong ``PYTHONPATH`` cannot pass as that release; says both in the
  report header.
* Runs the tests ``tests/gpu_release/selection.py`` chooses and deselects the
  other tests of their modules.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selection import EVERY_TEST, chosen  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    import vllm
    from vllm.platforms import current_platform

    from composer.testing.gpu_platform import CudaPlatformStandIn

    wanted = os.environ.get("KVC_VLLM_RELEASE", "")
    if vllm.__version__ != wanted:
        raise pytest.UsageError(
            f"vLLM {wanted!r} was asked for; `import vllm` gives {vllm.__version__} "
            f"({vllm.__file__})"
        )
    if not isinstance(current_platform, CudaPlatformStandIn):
        raise pytest.UsageError(
            f"vLLM's platform is {type(current_platform).__name__}, not the stand-in"
        )


def pytest_report_header(config: pytest.Config) -> str:
    import vllm
    from vllm.platforms import current_platform

    where = os.path.dirname(vllm.__file__)
    return f"vLLM {vllm.__version__} from {where}; platform {type(current_platform).__name__}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    choice = chosen()
    kept, deselected = [], []
    for item in items:
        tests = choice.get(Path(item.path).resolve(), {})
        unit = item.nodeid.split("::")[1].split("[")[0] if "::" in item.nodeid else ""
        (kept if EVERY_TEST in tests or unit in tests else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
