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
