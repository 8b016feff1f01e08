"""`make demo` is the project's main job: run it as a user would, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_kvc_demo_shows_hits_with_identical_output() -> None:
    kvc = Path(sys.executable).with_name("kvc")
    # As a user runs it: only the installed plugins.
    env = {k: v for k, v in os.environ.items() if k != "KV_COMPOSER_PLUGIN_MODULES"}
    done = subprocess.run(
        [str(kvc), "demo"],
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "every output equals the reference: True" in out
    served = [line for line in out.splitlines() if " cpu: " in line]
    assert len(served) >= 3, out  # two repeats and the shared prefix were served by the tier
    assert " NO" not in out
