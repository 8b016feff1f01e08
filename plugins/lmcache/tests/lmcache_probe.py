"""What the lmcache fault nodes share: request latencies and a report per process.

A probe ``needs`` the lmcache node (``self.target``). It records, per request,
the seconds from its first lookup to ``request_finished``, keeps the node's
counters summed over the chain's reports (``total``), and writes its
``report()`` to ``<config.report>.<process>.json`` at every finished request
and at shutdown: a test still learns what happened if the engine's shutdown is
cut short.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from composer import Plugin, hookimpl


def _count(value: Any) -> int:
    """A counter, or a per-hook one (``unavailable``) summed."""
    return sum(value.values()) if isinstance(value, dict) else int(value)


class LatencyProbe(Plugin):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        (self.target,) = ctx.needs.values()
        self.seen: dict[str, float] = {}
        self.latency: dict[str, float] = {}
        #: A report may be written from a thread of the probe's own as well.
        self._write_lock = threading.Lock()
        self._taken = {"errors": 0, "tokens_loaded": 0, "unavailable": 0}
        stats = self.target.stats
        take = stats.take

        def counting_take() -> dict[str, Any]:
            snapshot: dict[str, Any] = take()
            for name in self._taken:
                self._taken[name] += _count(snapshot.get(name, 0))
            return snapshot

        stats.take = counting_take

    def total(self, counter: str) -> int:
        """The lmcache node's ``counter`` since the start (the chain resets it at each report)."""
        return self._taken[counter] + _count(getattr(self.target.stats, counter))

    def first_lookup(self, request: Any) -> int | None:
        """The request's ordinal (1-based) at its first lookup; None at later ones."""
        if request.request_id in self.seen:
            return None
        self.seen[request.request_id] = time.monotonic()
        return len(self.seen)

    def report(self) -> dict[str, Any]:
        raise NotImplementedError

    @hookimpl
    def request_finished(self, request: Any) -> tuple[bool, None]:
        start = self.seen.get(request.request_id)
        if start is not None:
            self.latency[request.request_id] = time.monotonic() - start
            self.write_report()
        return False, None

    @hookimpl
    def shutdown(self) -> None:
        self.write_report()

    def write_report(self) -> None:
        path = f"{self.config.report}.{self.ctx.process}.json"
        totals = {name: self.total(name) for name in self._taken}
        with self._write_lock:
            with open(f"{path}.tmp", "w") as f:
                json.dump({**self.report(), "latency": dict(self.latency), "totals": totals}, f)
            os.replace(f"{path}.tmp", path)  # a reader never sees half a report
