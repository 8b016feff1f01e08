"""Stopping a server the project started in its own process group (``start_new_session``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def stop_group(proc: subprocess.Popen[Any], grace: float = 60.0) -> None:
    """SIGTERM to the server first, up to ``grace`` seconds to stop by itself (vLLM's
    API server then stops its engine and unlinks its shared memory); whatever
    outlives that, its whole process group, is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
