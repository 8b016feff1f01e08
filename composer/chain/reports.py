"""Stats and events: what the nodes report, gathered per node id.

A node's counters (:class:`NodeStats`) are reported only when something was
counted: every write marks a flag shared by the chain's nodes, so a quiet step
costs one check. A node's own ``get_kv_connector_stats`` result travels beside
its counters; KV cache events are concatenated (scheduler) or merged (worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from composer.chain import dispatch
from composer.chain.base import ChainBase


class Reports(ChainBase):
    take_stats: Callable[[], dict[str, dict[str, Any]]]
    get_kv_connector_stats: Callable[[], Any]
    get_kv_connector_kv_cache_events: Callable[[], Any]
    take_events: Callable[[], Iterable[Any]]

    def _bind_reports(self) -> None:
        self.take_stats = self._make_take_stats()
        self.get_kv_connector_stats = self._make_take_stats(self.stats_type or _data_or_none)
        self.get_kv_connector_kv_cache_events = self._make_kv_cache_events()
        self.take_events = self._make_take_events()

    def _make_take_stats(self, wrap: Callable[..., Any] | None = None) -> Callable[[], Any]:
        """``take_stats``; with ``wrap``, ``get_kv_connector_stats`` (wrap(data=...) or None)."""
        calls, fault = self.calls["get_kv_connector_stats"], self.fault
        changes = self.stats_changes
        nothing: dict[str, Any] | None = None if wrap is not None else {}

        def take_stats() -> Any:
            own: dict[str, Any] | None = None
            for node_id, fn in calls:
                try:
                    node_stats = fn()
                except Exception as exc:
                    fault(node_id, "get_kv_connector_stats", exc)
                    continue
                if node_stats is not None:
                    if own is None:
                        own = {}
                    own[node_id] = node_stats
            if own is None and not changes.seen:
                return nothing  # the usual step: no node counted anything
            # Cleared before reading, so a count made meanwhile (a node's own
            # thread) marks it again for the next report instead of being lost.
            changes.seen = False
            out = self._stats_entries(own)
            if wrap is None:
                return out
            return wrap(data=out) if out else None

        return take_stats

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

    def _make_kv_cache_events(self) -> Callable[[], Any]:
        calls, fault = self.calls["get_kv_connector_kv_cache_events"], self.fault
        if not calls:
            return dispatch.none

        def get_kv_connector_kv_cache_events() -> Any:
            merged = None
            for node_id, fn in calls:
                try:
                    events = fn()
                except Exception as exc:
                    fault(node_id, "get_kv_connector_kv_cache_events", exc)
                    continue
                if events is not None:
                    merged = events if merged is None else merged.merge(events)
            return merged

        return get_kv_connector_kv_cache_events

    def _make_take_events(self) -> Callable[[], Iterable[Any]]:
        calls, fault = self.calls["take_events"], self.fault
        if not calls:
            return dispatch.no_events

        def take_events() -> Iterable[Any]:
            for node_id, fn in calls:
                try:
                    for event in fn():
                        # vLLM's stored/removed events name the offloading tier
                        # that made them in ``ownership``: the node, unless set.
                        if getattr(event, "ownership", "") is None:
                            event.ownership = node_id
                        yield event
                except Exception as exc:
                    fault(node_id, "take_events", exc)

        return take_events


def _data_or_none(data: dict[str, Any]) -> dict[str, Any] | None:
    return data or None
