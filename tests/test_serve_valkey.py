"""``kvc serve --valkey``: a local Valkey for the server's lifetime, its port given to the file.

vLLM's ``serve --help`` stands in for a server (it starts, prints and exits), so
the test needs no model: what matters is that the pipeline file read the port,
the store answered while the server ran, and the kernel stopped it after.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from composer.servers.valkey import ping

PIPELINE = """\
version: 1
nodes:
  lmcache:
    plugin: lmcache
    config:
      server:
        l2:
          - type: resp
            host: ${VALKEY_HOST}
            port: ${VALKEY_PORT}
"""


def _kvc(*args: str) -> subprocess.CompletedProcess[str]:
    kvc = Path(sys.executable).with_name("kvc")
    return subprocess.run([str(kvc), *args], capture_output=True, text=True, timeout=300)


def _gone(port: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while ping("127.0.0.1", port, timeout=0.5):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_store_runs_with_the_server_and_stops_when_it_exits(tmp_path: Path) -> None:
    file = tmp_path / "fleet.yaml"
    file.write_text(PIPELINE)
    done = _kvc("serve", "--valkey", str(file), "--", "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    started = re.search(r"valkey-server on 127\.0\.0\.1:(\d+) \(pid (\d+)", done.stderr)
    assert started, done.stderr[-2000:]
    port = int(started.group(1))
    # The pipeline handed to vLLM names that port (its file was validated with it).
    assert "--kv-transfer-config" in done.stderr
    assert _gone(port), f"valkey-server on {port} outlived kvc serve"


def test_an_invalid_file_stops_the_store_and_exits_2(tmp_path: Path) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(PIPELINE.replace("port: ${VALKEY_PORT}", "port: 70000"))
    done = _kvc("serve", "--valkey", str(file), "--", "--help")
    assert done.returncode == 2
    assert "port" in done.stderr and "Traceback" not in done.stderr
    started = re.search(r"valkey-server on 127\.0\.0\.1:(\d+)", done.stderr)
    assert started and _gone(int(started.group(1)))
