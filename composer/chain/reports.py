"""Stats and events: what the nodes report, gathered per node id.

A node's counters (:class:`NodeStats`) are reported only when something was
counted: every write marks a flag shared by the chain's nodes, so a quiet step
costs one check. A node's own ``get_kv_connector_stats`` result travels beside
its counters; KV cache events are concatenated (scheduler) or merged (worker).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from composer.chain.base import ChainBase

#: vLLM's KV cache event classes, by name, and the node counter each adds to.
EVENT_COUNTERS = {
    "BlockStored": "events_stored",
    "BlockRemoved": "events_removed",
    "AllBlocksCleared": "events_cleared",
}


class Reports(ChainBase):
    def take_stats(self) -> dict[str, dict[str, Any]]:
        """Every node's counters and own stats since the last report, by node id."""
        out = self.get_kv_connector_stats()
        return getattr(out, "data", out) or {}

    def get_kv_connector_stats(self) -> Any:
        """:meth:`take_stats` wrapped in vLLM's stats type (``stats_type``); None if empty."""
        own: dict[str, Any] | None = None
        for node_id, fn in self.calls["get_kv_connector_stats"]:
            try:
                node_stats = fn()
            except Exception as exc:
                self.fault(node_id, "get_kv_connector_stats", exc)
                continue
            if node_stats is not None:
                if own is None:
                    own = {}
                own[node_id] = node_stats
        if own is None and not self.stats_changes.seen:
            return None  # the usual step: no node counted anything
        # Cleared before reading, so a count made meanwhile (a node's own
        # thread) marks it again for the next report instead of being lost.
        self.stats_changes.seen = False
        out = self._stats_entries(own)
        if not out:
            return None
        return self.stats_type(data=out) if self.stats_type is not None else out

    def _stats_entries(self, own: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for node_id, stats in self.stats.items():
            node_stats = own.get(node_id) if own else None
            if node_stats is None and stats.is_empty():
                continue
            entry: dict[str, Any] = {
                "plugin": self.plugin_names[node_id],
                "counters": stats.take(),
            }
            if node_stats is not None:
                entry["node"] = node_stats
            out[node_id] = entry
        return out

    def get_kv_connector_kv_cache_events(self) -> Any:
        """The nodes' KV cache events, merged (``a.merge(b)``) in node order."""
        merged = None
        for node_id, fn in self.calls["get_kv_connector_kv_cache_events"]:
            try:
                events = fn()
            except Exception as exc:
                self.fault(node_id, "get_kv_connector_kv_cache_events", exc)
                continue
            if events is not None:
                merged = events if merged is None else merged.merge(events)
        return merged

    def take_events(self) -> Iterable[Any]:
        """The nodes' new KV cache events, one node after the other (first the last
        events of nodes switched off since the previous step)."""
        if self.parting_events:
            parting, self.parting_events = self.parting_events, []
            yield from parting
        for node_id, fn in self.calls["take_events"]:
            try:
                events = fn()
                # The usual step: an empty list or tuple, and nothing to count.
                if events:
                    yield from self.owned_events(node_id, events)
            except Exception as exc:
                self.fault(node_id, "take_events", exc)

    def owned_events(self, node_id: str, events: Iterable[Any]) -> Iterable[Any]:
        """The node's events, each naming its node, counted on the node's stats
        (``events_stored``/``events_removed``: blocks announced; ``events_cleared``)."""
        counted: dict[str, int] = {}
        for event in events:
            # vLLM's stored/removed events name the offloading tier that made
            # them in ``ownership``: the node, unless set.
            if getattr(event, "ownership", "") is None:
                event.ownership = node_id
            kind = EVENT_COUNTERS.get(type(event).__name__)
            if kind is not None:
                blocks = len(getattr(event, "block_hashes", None) or ()) or 1
                counted[kind] = counted.get(kind, 0) + blocks
            yield event
        stats = self.stats.get(node_id)
        if stats is not None:
            for name, count in counted.items():
                stats.extra.add(name, count)
