"""How test and demo engine runs stop their process group (real processes, no vLLM)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from composer.servers import group_alive
from composer.testing.engine import stop_engine


def leader_leaving(child_code: str) -> subprocess.Popen[bytes]:
    """A group leader that starts a child running ``child_code`` and exits at once."""
    leader = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child_code!r}])"
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    proc.wait(timeout=30)
    return proc


def test_a_child_still_tearing_down_is_left_to_finish(tmp_path: Path) -> None:
    done = tmp_path / "done"
    proc = leader_leaving(
        f"import time, pathlib; time.sleep(2); pathlib.Path({str(done)!r}).touch()"
    )
    assert group_alive(proc.pid)
    stop_engine(proc, grace_s=60)
    assert done.exists()  # it finished on its own instead of being killed
    assert not group_alive(proc.pid)


def test_a_stuck_child_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = leader_leaving(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    )
    start = time.monotonic()
    stop_engine(proc, grace_s=1, signal_wait_s=1)  # (engines get 10 s after SIGTERM)
    assert not group_alive(proc.pid)
    assert time.monotonic() - start < 10
