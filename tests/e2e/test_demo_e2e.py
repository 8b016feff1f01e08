"""`make demo` is the project's main job: run it as a user would, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

NAMES = [
    "A, first time", "B, first time", "C, first time",
    "A again", "B again", "A's start, new end", "D, first time",
]


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
    rows = {name: line for line in out.splitlines() for name in NAMES if f"  {name} " in line}
    assert sorted(rows) == sorted(NAMES), out
    # What was seen before is served by the tier, what was not is computed.
    served = {name for name, line in rows.items() if " cpu: " in line}
    assert served == {"A again", "B again", "A's start, new end"}, out
    assert " NO" not in out
