"""A test plugin that SIGKILLs the LMCache server from inside the engine.

Registered in vLLM's processes through ``$KV_COMPOSER_PLUGIN_MODULES``. The
``lmcache-killer`` node comes first in ``load_order`` and ``needs`` the lmcache
node. In the scheduler it kills the server when it first sees the
``at_request``-th request (round 2's first, for example): at once, then holding
the scheduler ``settle_s`` (a kill between rounds, noticed before round 2 is
scheduled), or ``delay_s`` later from a timer (a kill while the round is in
flight). In every process it records, per request, the seconds from its first
lookup to ``request_finished``, and at shutdown writes what the lmcache node
reported (its liveness flag, outages seen, and every ``errors`` / ``server_down``
count the chain took from its stats) to ``<report>.<vllm role>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from composer import Plugin, PluginType, hookimpl


class KillerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    report: str
    at_request: int
    delay_s: float = 0.0
    settle_s: float = 0.0
    #: The server to kill; None: the lmcache node's own (started) server.
    pid: int | None = None


class Killer(Plugin):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        (self.target,) = ctx.needs.values()
        self.seen: dict[str, float] = {}
        self.latency: dict[str, float] = {}
        self.killed_at: float | None = None
        self.totals = {"errors": 0, "server_down": 0}
        stats = self.target.stats
        take = stats.take

        def counting_take() -> dict[str, Any]:
            snapshot: dict[str, Any] = take()
            self.totals["errors"] += int(snapshot.get("errors", 0))
            self.totals["server_down"] += int(snapshot.get("extra", {}).get("server_down", 0))
            return snapshot

        stats.take = counting_take

    def _kill(self) -> None:
        pid = self.config.pid or self.target.server.pid
        os.kill(pid, signal.SIGKILL)
        self.killed_at = time.monotonic()  # system-wide: comparable across processes

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:
        if request.request_id not in self.seen:
            self.seen[request.request_id] = time.monotonic()
            if len(self.seen) == self.config.at_request:
                if self.config.delay_s > 0:
                    threading.Timer(self.config.delay_s, self._kill).start()
                else:
                    self._kill()
                    time.sleep(self.config.settle_s)
        return 0, False

    @hookimpl
    def request_finished(self, request: Any) -> tuple[bool, None]:
        start = self.seen.get(request.request_id)
        if start is not None:
            self.latency[request.request_id] = time.monotonic() - start
        return False, None

    @hookimpl
    def shutdown(self) -> None:
        stats = self.target.stats
        down_since = self.target._down_since if self.target.down_events else None
        report = {
            "killed_at": self.killed_at,
            "down_since": down_since,
            "latency": self.latency,
            "server_alive": self.target.server_alive,
            "down_events": self.target.down_events,
            "gauge_server_alive": stats.gauges.get("server_alive"),
            "errors": self.totals["errors"] + stats.errors,
            "server_down": self.totals["server_down"] + stats.extra.get("server_down", 0),
            "disabled": stats.disabled,
        }
        with open(f"{self.config.report}.{self.ctx.vllm_role}.json", "w") as f:
            json.dump(report, f)


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
