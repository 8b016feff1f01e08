"""What a started server's L2 tiers did, from its Prometheus text at ``GET /metrics``.

LMCache's ``/status`` says only whether each adapter's thread runs; a RESP
adapter whose Valkey is gone stays "healthy" there. Its metrics count the
work: chunks submitted to L2 for storing, chunks stored, keys that failed to
load, and tokens served from L2. A failed store publishes its completion
without a chunk count, so chunks submitted but never stored are the store
failures (plus, for a moment, stores still in flight).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: gauge name -> the metric summed over all its label sets.
METRICS = {
    "l2_store_chunks": "lmcache_mp_l2_store_submitted_objects_chunks_total",
    "l2_stored_chunks": "lmcache_mp_l2_store_completed_objects_chunks_total",
    "l2_load_failed": "lmcache_mp_l2_prefetch_failure_chunks_total",
    "l2_loaded_chunks": "lmcache_mp_l2_prefetch_load_completed_chunks_total",
    "l2_hit_tokens": "lmcache_mp_lookup_hit_l2_tokens_total",
}
GAUGES = (*METRICS, "l2_failed", "l2_errors")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def parse(text: str) -> dict[str, int]:
    """The L2 gauges from Prometheus exposition text (absent metrics count 0)."""
    sums = dict.fromkeys(METRICS.values(), 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match and match["name"] in sums:
            try:
                sums[match["name"]] += float(match["value"])
            except ValueError:
                continue
    out = {gauge: int(sums[metric]) for gauge, metric in METRICS.items()}
    out["l2_failed"] = max(0, out["l2_store_chunks"] - out["l2_stored_chunks"]) + out[
        "l2_load_failed"
    ]
    out["l2_errors"] = 0
    return out


def adapter_errors(status: Any) -> int:
    """Failed operations the adapters count themselves (``errors`` in ``/status``).

    KV Composer's RESP wrapper counts every failed operation, lookups included
    (LMCache's metrics count failed stores and loads only).
    """
    adapters = (status or {}).get("storage_manager", {}).get("l2_adapters", [])
    return sum(int(a.get("errors", 0)) for a in adapters if isinstance(a, dict))


def scrape(http_url: str, timeout: float = 1.0) -> dict[str, int] | None:
    """The server's L2 gauges now; None when its HTTP frontend does not answer."""
    try:
        with urllib.request.urlopen(f"{http_url}/metrics", timeout=timeout) as response:  # noqa: S310
            out = parse(response.read().decode(errors="replace"))
        with urllib.request.urlopen(f"{http_url}/status", timeout=timeout) as response:  # noqa: S310
            out["l2_errors"] = adapter_errors(json.loads(response.read()))
        return out
    except (OSError, ValueError, urllib.error.URLError):
        return None


# -- outages -------------------------------------------------------------------- #

#: Counters that only grow while one server runs (a new server starts them at 0).
_COUNTERS = (*METRICS, "l2_errors")
#: Counters whose growth is L2 work done, by the kind of work: stores completed;
#: loads completed, and lookups that found chunks in L2.
_SERVED = {
    "store": ("l2_stored_chunks",),
    "load": ("l2_loaded_chunks", "l2_hit_tokens"),
}


@dataclass(frozen=True)
class L2Change:
    """An L2 outage began (``serving`` false) or ended (``serving`` true) at a reading."""

    serving: bool
    #: Failed operations seen: in this reading when it began, in the whole outage when it ended.
    failures: int
    #: Seconds from the reading that showed it to the one that ended it (0 when it began).
    down_s: float = 0.0


class L2Health:
    """Whether the server's L2 tiers serve, from successive readings of :data:`GAUGES`.

    An L2 store that fails (Valkey gone, a directory read-only) fails inside the
    server: nothing reaches the node but these counters. A reading with failures
    the previous one did not have begins an outage. It ends at the first reading
    with no new failures once each kind of work that failed has been seen done
    again: stores for failed stores, loads or L2 lookup hits for failed loads,
    any work for failures the adapter counted (the RESP wrapper counts every
    failed operation). A reading with no work changes nothing: a store is back
    only once seen serving. So an outage is seen within one reading interval of
    its first failure, and its end within one interval of the work that shows
    it; with several tiers, one failing is an outage of the node's L2.

    LMCache counts a store submitted and a store completed, not a store failed:
    a store submitted before the previous reading and still not completed now
    (a whole interval later) is counted failed; one merely in flight is not.
    """

    def __init__(self) -> None:
        self.serving = True
        self.outages = 0
        self._last: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        #: Most stores ever counted failed (see :meth:`observe`) since the baseline.
        self._stores_failed = 0
        #: The kinds of work failing in this outage: "store", "load", "any".
        self._failing: set[str] = set()
        self._since = 0.0
        self._failures = 0

    def new_server(self) -> None:
        """The server is being replaced: the next reading's counters start again at 0."""
        self._last = dict.fromkeys(_COUNTERS, 0)
        self._stores_failed = 0

    def observe(self, counts: Mapping[str, int], now: float) -> L2Change | None:
        """Take one reading (``now``: a monotonic clock); the change it makes, if any."""
        if any(counts[key] < self._last[key] for key in _COUNTERS):
            # Counters went back: a new server (restarted by the engine's other
            # process) counts from 0.
            self.new_server()
        last, self._last = self._last, {key: int(counts[key]) for key in _COUNTERS}
        # Stores submitted by the last reading less all stores completed by now: the
        # failed ones among them (one still unfinished a whole interval later
        # counts failed), less the stores submitted since that completed. So it
        # may miss a failure for a while, never counts a store merely in flight,
        # and only new failures take it past its highest value.
        stores_failed = max(0, last["l2_store_chunks"] - counts["l2_stored_chunks"])
        grown = {
            "any": counts["l2_errors"] - last["l2_errors"],
            "load": counts["l2_load_failed"] - last["l2_load_failed"],
            "store": max(0, stores_failed - self._stores_failed),
        }
        self._stores_failed = max(self._stores_failed, stores_failed)
        failed = {kind for kind, n in grown.items() if n > 0}
        served = {kind for kind, keys in _SERVED.items() if any(counts[k] > last[k] for k in keys)}
        # A kind of work done again (and not failing in this very reading) fails no more.
        self._failing -= served - failed
        if served and "any" not in failed:
            self._failing.discard("any")
        if failed:
            self._failing |= failed
            self._failures += sum(grown.values())
            if not self.serving:
                return None
            self.serving, self._since, self._failures = False, now, sum(grown.values())
            self.outages += 1
            return L2Change(serving=False, failures=self._failures)
        if not self.serving and not self._failing:
            self.serving = True
            return L2Change(serving=True, failures=self._failures, down_s=now - self._since)
        return None
