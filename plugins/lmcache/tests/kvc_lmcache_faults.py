"""Test plugins that SIGKILL the LMCache server from inside the engine.

Registered in vLLM's processes through ``$KV_COMPOSER_PLUGIN_MODULES``. The
``lmcache-killer`` node comes first in ``load_order`` and ``needs`` the lmcache
node. In the scheduler it kills the server when it first sees the
``at_request``-th request (round 2's first, for example): at once, then holding
the scheduler ``settle_s`` (a kill between rounds, noticed before round 2 is
scheduled), or ``delay_s`` later from a timer (a kill while the round is in
flight). In every process it records, per request, the seconds from its first
lookup to ``request_finished``, and at shutdown writes what the lmcache node
reported (its liveness flag and gauges, outages seen, and every ``errors``
count the chain took from its stats) to ``<report>.<process>.json``.

The ``lmcache-chaos`` node kills the node's own (started) server again and
again under load: at the first lookup of each request ordinal in ``kill_at``,
before the lmcache node's lookups of that step go out. At each ordinal in
``resume_by`` it holds the scheduler until the node has resumed (the node
restarts its server by itself) in both chain halves: in a served engine the
worker's half is another process, whose node resumes on its own watcher a
moment after the scheduler's; it says each resume in ``<report>.resumed``
(how many so far), and the scheduler waits for that count too. So the
outages end where the test expects.
It records each outage's times as the node saw them, and vLLM's free KV
blocks at every new request. In every process, once the node has noticed an
outage, it sends LMCache's client one more request (a ping), as a store begun
before LMCache was degraded sends its commit afterwards, and records how its
wait ended: the node must end it while the server is still away, not leave it
to ``mq_timeout`` or to whichever server answers next.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lmcache_probe import LatencyProbe
from pydantic import BaseModel, ConfigDict

from composer import PluginType, hookimpl


class KillerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    report: str
    at_request: int
    delay_s: float = 0.0
    settle_s: float = 0.0
    #: The server to kill; None: the lmcache node's own (started) server.
    pid: int | None = None
    #: After the kill and settle_s: start a server where the killed one was
    #: (same ports, this chunk size), hold the scheduler until the node resumes,
    #: then settle_s more (the worker's node resumes on its own heartbeat).
    restart_chunk_size: int | None = None


class Killer(LatencyProbe):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.killed_at: float | None = None
        self.restarted_pid: int | None = None
        self.resumed_at: float | None = None

    def _kill(self) -> None:
        pid = self.config.pid or self.target.supervisor.server.pid
        os.kill(pid, signal.SIGKILL)
        self.killed_at = time.monotonic()  # system-wide: comparable across processes

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:
        if self.first_lookup(request) != self.config.at_request:
            return 0, False
        if self.config.delay_s > 0:
            threading.Timer(self.config.delay_s, self._kill).start()
        else:
            self._kill()
            time.sleep(self.config.settle_s)
            if self.config.restart_chunk_size:
                self._restart()
        return 0, False

    def _restart(self) -> None:
        from kvc_lmcache.server_process import ServerSettings, start_server

        server = self.target.supervisor.server
        http_port = server.http_port or urlparse(self.target.config.server.http_url).port
        settings = ServerSettings(chunk_size=self.config.restart_chunk_size, l1_size_gb=0.25)
        log = f"{self.config.report}.restarted.log"
        info = start_server(settings, Path(log), port=server.port, http_port=http_port)
        self.restarted_pid = info.pid
        deadline = time.monotonic() + 120
        while not self.target.supervisor.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        self.resumed_at = time.monotonic()
        time.sleep(self.config.settle_s)

    def report(self) -> dict[str, Any]:
        stats = self.target.stats
        supervisor = self.target.supervisor
        down_since = supervisor.down_since if supervisor.down_events else None
        return {
            "killed_at": self.killed_at,
            "down_since": down_since,
            "restarted_pid": self.restarted_pid,
            "resumed_at": self.resumed_at,
            "server_alive": self.target.supervisor.alive,
            "down_events": self.target.supervisor.down_events,
            "gauge_server_alive": stats.gauges.get("server_alive"),
            "errors": self.total("errors"),
            "unavailable": self.total("unavailable"),
            "server_outages": stats.gauges.get("server_outages"),
            "disabled": stats.disabled,
        }


class ChaosConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    report: str
    kill_at: list[int]
    resume_by: list[int]
    resume_timeout_s: float = 120.0


#: The lmcache node of each chain half in this process (an in-process engine has both;
#: in a served one the scheduler half resumes only once the worker has registered).
TARGETS: list[Any] = []


class Chaos(LatencyProbe):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        TARGETS.append(self.target)
        self.outages: list[dict[str, Any]] = []
        self.free_blocks: list[int] = []
        self.pool: Any = None
        self.alive_at_last_lookup: bool | None = None
        #: Per outage: how the late request's wait ended.
        self.late_waits: list[dict[str, Any]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._send_late_requests, daemon=True).start()
        if ctx.process == "worker":
            threading.Thread(target=self._say_resumes, daemon=True).start()

    def _say_resumes(self) -> None:
        """The worker's half: each time its node resumes, the count in ``<report>.resumed``
        (a save skipped before then would be missed the round after)."""
        supervisor, resumes, was_alive = self.target.supervisor, 0, True
        while not self._stop.wait(0.01):
            alive = supervisor.alive
            if alive and not was_alive:
                resumes += 1
                path = f"{self.config.report}.resumed"
                Path(f"{path}.tmp").write_text(str(resumes))
                os.replace(f"{path}.tmp", path)
            was_alive = alive

    def _worker_resumes(self) -> int:
        """How often the worker's half (another process) has resumed."""
        path = Path(f"{self.config.report}.resumed")
        return int(path.read_text()) if path.exists() else 0

    def _send_late_requests(self) -> None:
        target = self.target
        # One per kill (at the engine's shutdown the server may die too: not one of them).
        while not self._stop.wait(0.01) and len(self.late_waits) < len(self.config.kill_at):
            if target.supervisor.alive or target.supervisor.down_events <= len(self.late_waits):
                continue
            connector = target.connector
            adapter = getattr(connector, "worker_adapter", None) or connector.scheduler_adapter
            client = getattr(adapter, "req_client", None) or next(
                iter(adapter.req_clients.values())
            )
            sent_at = time.monotonic()
            future = client.ping(None)
            ended = future.wait(timeout=target.config.server.mq_timeout)
            self.late_waits.append(
                {
                    "seconds": time.monotonic() - sent_at,
                    "ended": ended,
                    "error": str(future.exception_) if future.exception_ else None,
                    "node_resumed": target.supervisor.alive,
                }
            )
            self.write_report()

    @hookimpl
    def shutdown(self) -> None:
        self._stop.set()
        super().shutdown()

    @hookimpl
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.pool = kv_cache_manager.block_pool

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:
        ordinal = self.first_lookup(request)
        if ordinal is None:
            return 0, False
        if self.pool is not None:
            self.free_blocks.append(self.pool.get_num_free_blocks())
        # At the engine's shutdown the server may die with the process that
        # started it (and is not restarted then): record it as the last request saw it.
        self.alive_at_last_lookup = self.target.supervisor.alive
        if ordinal in self.config.kill_at:
            pid = self.target.shared.pid()
            os.kill(pid, signal.SIGKILL)
            self.outages.append({"killed_pid": pid, "killed_at": time.monotonic()})
        if ordinal in self.config.resume_by:
            # Both chain halves' nodes: the scheduler's lookups, the worker's saves (in
            # this process when the engine runs in one, else as the worker says).
            apart = len(TARGETS) == 1
            deadline = time.monotonic() + self.config.resume_timeout_s
            while time.monotonic() < deadline and not (
                all(t.supervisor.alive for t in TARGETS)
                and (not apart or self._worker_resumes() >= len(self.outages))
            ):
                time.sleep(0.05)
            outage = self.outages[-1]
            outage["back_at"] = min(t.supervisor.back_at or 0 for t in TARGETS)
            resumed = [t.supervisor.resumed_at for t in TARGETS if t.supervisor.alive]
            outage["resumed_at"] = max(resumed) if len(resumed) == len(TARGETS) else None
            outage["restarted_pid"] = self.target.supervisor.server.pid
            outage["halves"] = len(TARGETS)
            outage["worker_resumes"] = self._worker_resumes() if apart else None
        return 0, False

    def report(self) -> dict[str, Any]:
        return {
            "outages": self.outages,
            "free_blocks": self.free_blocks,
            "gauges": dict(self.target.stats.gauges),
            "alive_at_last_lookup": self.alive_at_last_lookup,
            "late_waits": self.late_waits,
            "disabled": self.target.stats.disabled,
        }


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="lmcache-killer",
            node=Killer,
            config=KillerConfig,
            default_role="load",
            roles=frozenset({"load"}),
        )
    )
    register(
        PluginType(
            name="lmcache-chaos",
            node=Chaos,
            config=ChaosConfig,
            default_role="load",
            roles=frozenset({"load"}),
        )
    )
