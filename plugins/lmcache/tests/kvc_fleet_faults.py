"""A test plugin that acts on the fleet's stores from inside a running engine.

Registered in vLLM's processes through ``$KV_COMPOSER_PLUGIN_MODULES``. The
``fleet-faults`` node comes first in ``load_order`` and ``needs`` the lmcache
node. In the scheduler, when it first sees the N-th request (1-based; round
``r``'s first request is ``r * prompts + 1``), it runs that request's actions
in order, before the lmcache node looks the request up:

* ``kill_valkey``: SIGKILL the Valkey server (pid from the config);
* ``kill_valkey_in_flight``: the same, ``delay_s`` later from a timer, while
  the round's requests are being computed and saved;
* ``wait_valkey_dead``: wait for that timer's kill to have happened and the
  process to be gone (its port free);
* ``restart_valkey``: start ``valkey-server`` again on its port (empty);
* ``wait_l2_connected``: hold the scheduler until the lmcache server's RESP
  adapter says it is connected again (its ``/status``): the Valkey outage's end;
* ``clear_l1``: empty the lmcache server's L1 (``POST /cache/clear``), so the
  next lookups can only hit in its L2 tiers;
* ``corrupt_fs``: damage every chunk file under ``fs_path``: every other one
  truncated to half its length, the others with 64 bytes in the middle flipped;
* ``fs_gone``: move the directory ``fs_path`` away and put a file in its place,
  so every open under it fails (a volume gone or remounted; as root,
  ``chmod`` would not stop a write); ``fs_back`` puts the directory back;
* ``settle``: hold the scheduler ``settle_s`` seconds.

It records per request the seconds from its first lookup to
``request_finished``, and writes (at every finished request and at shutdown)
what it did and the lmcache node's gauges to ``<report>.<process>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

from lmcache_probe import LatencyProbe
from pydantic import BaseModel, ConfigDict

from composer import PluginType, hookimpl

Action = Literal[
    "kill_valkey",
    "kill_valkey_in_flight",
    "wait_valkey_dead",
    "restart_valkey",
    "wait_l2_connected",
    "clear_l1",
    "corrupt_fs",
    "fs_gone",
    "fs_back",
    "settle",
]


class FleetFaultsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    report: str
    #: Request ordinal (1-based, as a string key) -> actions.
    actions: dict[str, list[Action]]
    valkey_pid: int | None = None
    valkey_port: int | None = None
    valkey_workdir: str | None = None
    fs_path: str | None = None
    delay_s: float = 0.3
    settle_s: float = 1.0


class FleetFaults(LatencyProbe):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.done: list[tuple[int, str, float]] = []
        self.valkey_pid = self.config.valkey_pid
        self.restarted_pids: list[int] = []
        self.corrupted = {"truncated": 0, "flipped": 0}
        self._timer: threading.Timer | None = None

    # -- actions ------------------------------------------------------------- #

    def _kill_valkey(self) -> None:
        assert self.valkey_pid is not None
        os.kill(self.valkey_pid, signal.SIGKILL)
        self._wait_dead(self.valkey_pid)

    @staticmethod
    def _wait_dead(pid: int, timeout: float = 10.0) -> None:
        """SIGKILL is delivered asynchronously: wait until the process holds no socket."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                return
            if state in ("Z", "X"):
                return
            time.sleep(0.01)
        raise TimeoutError(f"valkey-server {pid} still runs {timeout} s after SIGKILL")

    def _corrupt_fs(self) -> None:
        assert self.config.fs_path is not None
        files = sorted(p for p in Path(self.config.fs_path).rglob("*") if p.is_file())
        for i, path in enumerate(files):
            data = bytearray(path.read_bytes())
            if i % 2 == 0:
                path.write_bytes(bytes(data[: len(data) // 2]))
                self.corrupted["truncated"] += 1
            else:
                middle = len(data) // 2
                for j in range(middle, min(middle + 64, len(data))):
                    data[j] ^= 0xFF
                path.write_bytes(bytes(data))
                self.corrupted["flipped"] += 1

    def _fs_gone(self) -> None:
        assert self.config.fs_path is not None
        path = Path(self.config.fs_path)
        path.rename(path.with_name(path.name + ".away"))
        path.write_text("not a directory\n")

    def _fs_back(self) -> None:
        assert self.config.fs_path is not None
        path = Path(self.config.fs_path)
        path.unlink()
        path.with_name(path.name + ".away").rename(path)

    def _restart_valkey(self) -> None:
        from composer.servers.valkey import ValkeyServer, valkey_server_binary

        assert self.config.valkey_port is not None and self.config.valkey_workdir is not None
        server = ValkeyServer(
            host="127.0.0.1",
            port=self.config.valkey_port,
            workdir=Path(self.config.valkey_workdir),
            binary=valkey_server_binary(),
        ).start()
        assert server.pid is not None
        self.valkey_pid = server.pid
        self.restarted_pids.append(server.pid)
        self.write_report()  # the test stops it, also if the engine dies later

    def _wait_l2_connected(self, timeout: float = 30.0) -> None:
        http_url = self.target.server.http_url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{http_url}/status", timeout=5) as response:  # noqa: S310
                adapters = json.loads(response.read())["storage_manager"]["l2_adapters"]
            if all(a.get("connected", True) for a in adapters):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the RESP adapter did not reconnect within {timeout} s")

    def _clear_l1(self) -> None:
        http_url = self.target.server.http_url
        request = urllib.request.Request(
            f"{http_url}/cache/clear",
            data=json.dumps({"tier": "l1", "force": False}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
            assert json.loads(response.read())["status"] == "ok"

    def _run(self, ordinal: int, action: str) -> None:
        if action == "kill_valkey":
            self._kill_valkey()
        elif action == "kill_valkey_in_flight":
            self._timer = threading.Timer(self.config.delay_s, self._in_flight)
            self._timer.start()
            return
        elif action == "wait_valkey_dead":
            assert self._timer is not None
            self._timer.join(timeout=30)
        elif action == "restart_valkey":
            self._restart_valkey()
        elif action == "wait_l2_connected":
            self._wait_l2_connected()
        elif action == "clear_l1":
            self._clear_l1()
        elif action == "corrupt_fs":
            self._corrupt_fs()
        elif action == "fs_gone":
            self._fs_gone()
        elif action == "fs_back":
            self._fs_back()
        elif action == "settle":
            time.sleep(self.config.settle_s)
        self.done.append((ordinal, action, time.monotonic()))

    def _in_flight(self) -> None:
        self._kill_valkey()
        self.done.append((-1, "kill_valkey_in_flight", time.monotonic()))

    # -- hooks --------------------------------------------------------------- #

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:
        ordinal = self.first_lookup(request)
        if ordinal is None:
            return 0, False
        for action in self.config.actions.get(str(ordinal), []):
            self._run(ordinal, action)
        return 0, False

    @hookimpl
    def shutdown(self) -> None:
        # The lmcache node reads its server's L2 metrics every 2 s: read them now.
        self.target._scrape_l2()
        self.write_report()

    def report(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "restarted_pids": self.restarted_pids,
            "corrupted": self.corrupted,
            "gauges": dict(self.target.stats.gauges),
        }


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="fleet-faults",
            node=FleetFaults,
            config=FleetFaultsConfig,
            default_role="load",
            roles=frozenset({"load"}),
        )
    )
