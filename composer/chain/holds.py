"""Holding blocks: a finished request's blocks stay held while any node still saves
from them, and its nodes' ``kv_transfer_params`` are merged, a key written by two
nodes an error (but ``kv_composer``, where each node may write entries of its
own beside the chain's note). What the request's loads delivered (from
:class:`~composer.chain.loads.LoadPlanning`) is settled here too.

:class:`BlockHolding` is mixed into :class:`~composer.chain.scheduler.SchedulerChain`,
so vLLM's call reaches its method directly; what it uses of the chain is listed
in its body.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from composer.chain.calls import Call
from composer.chain.core import is_outage
from composer.chain.metadata import TransferParamsClash
from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.ranges import Range
from composer.stats import NodeStats
from composer.views import RequestViews

#: What a request_finished call that raised stands for.
FAULTED = object()
#: The ``kv_transfer_params`` key of what KV Composer says about a request.
NOTE = "kv_composer"


class BlockHolding:
    """The scheduler's hooks of a finished request."""

    # What it uses of the chain (:class:`~composer.chain.core.ChainCore`'s, the
    # scheduler chain's request views, what its load delivered): nothing else.
    if TYPE_CHECKING:
        pipeline: ResolvedPipeline
        calls: dict[str, list[tuple[str, Call]]]
        nodes: dict[str, Any]
        stats: dict[str, NodeStats]
        views: RequestViews

        def fault(self, node_id: str, hook: str, exc: BaseException) -> None: ...
        def results(self, hook: str, *args: Any, default: Any = None) -> list[tuple[str, Any]]: ...
        def loads_finished(self, request_id: str) -> tuple[list[Range], str | None]: ...

    def _init_holds(self) -> None:
        #: Request -> the nodes holding its blocks: sent with the next step's metadata.
        self.new_holds: dict[str, tuple[str, ...]] = {}

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        view = self.views.of(request)
        results = self.results("request_finished", view, block_ids, default=FAULTED)
        return self._finish(request, results)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not self.pipeline.hma:
            assert len(block_ids) == 1, (
                "HMA with several KV cache groups needs every node to support it"
            )
            return self.request_finished(request, block_ids[0])
        view = self.views.of(request)
        results: list[tuple[str, Any]] = []
        all_groups = dict(self.calls["request_finished_all_groups"])
        one_group = dict(self.calls["request_finished"])
        for node_id in self.nodes:
            # A node that implements only request_finished still hears of every
            # finished request (its first group's blocks), as vLLM tells a non-HMA one.
            groups = self._groups_for(node_id, block_ids)
            arg: Any = groups
            hook, fn = "request_finished_all_groups", all_groups.get(node_id)
            if fn is None:
                hook, fn, arg = "request_finished", one_group.get(node_id), groups[0]
            if fn is None:
                continue
            try:
                results.append((node_id, fn(view, arg)))
            except Exception as exc:
                self.fault(node_id, hook, exc)
                results.append((node_id, None if is_outage(hook, exc) else FAULTED))
        return self._finish(request, results)

    def _groups_for(self, node_id: str, block_ids: tuple[list[int], ...]) -> tuple[list[int], ...]:
        rnode: ResolvedNode = self.pipeline.node(node_id)
        group = getattr(rnode.config, "kv_cache_group", None)
        if rnode.capabilities.kv_cache_groups == "one" and isinstance(group, int):
            return (block_ids[group],)
        return block_ids

    def _finish(
        self, request: Any, results: Iterable[tuple[str, Any]]
    ) -> tuple[bool, dict[str, Any] | None]:
        holders, params = hold_and_params(results)
        self.views.drop(request.request_id)
        if holders:
            self.new_holds[request.request_id] = tuple(holders)
        loads, refused = self.loads_finished(request.request_id)
        for load in loads:
            self._settle(load)
        if self.pipeline.annotate_outputs or refused:
            note = self._note(loads) if self.pipeline.annotate_outputs else {}
            if refused:
                note["error"] = f"tier controls: {refused}"
            params = {**(params or {}), NOTE: {**(params or {}).get(NOTE, {}), **note}}
        return bool(holders), params

    def _note(self, loads: list[Range]) -> dict[str, Any]:
        """What the request's ``kv_transfer_params`` say about its load (annotate_outputs)."""
        served = [x for x in loads if x.delivered]
        note: dict[str, Any] = {
            # One node, or the ranges' nodes joined by "+" ("cpu+lmcache").
            "served_by": "+".join(x.node for x in served) or None,
            "tokens": sum(x.delivered for x in loads),
        }
        ranges = self.pipeline.load_policy == "ranges"
        if ranges:
            note["ranges"] = [
                {"node": x.node, "start": x.start, "tokens": x.delivered} for x in loads
            ]
        failed = [
            {"node": x.node, "tokens": x.tokens - x.delivered}
            for x in loads
            if x.delivered < x.tokens
        ]
        if failed:
            # One node's load: the node and its tokens; ranges: a list of those.
            note["failed"] = failed if ranges else failed[0]
        return note

    def _settle(self, load: Range) -> None:
        """Count what ``load`` delivered on its node's stats."""
        stats, delivered = self.stats[load.node], load.delivered
        stats.tokens_hit += delivered
        if delivered:
            stats.count_served(delivered)
        if delivered < load.tokens:
            stats.extra.add("loads_failed")
            stats.extra.add("tokens_load_failed", load.tokens - delivered)

    def register_finished_partial_tail(self, request: Any, block_ids: Any, offloads: Any) -> bool:
        view = self.views.of(request)
        results = self.results(
            "register_finished_partial_tail", view, block_ids, offloads, default=False
        )
        return any(r for _, r in results)


def hold_and_params(
    results: Iterable[tuple[str, Any]],
) -> tuple[list[str], dict[str, Any] | None]:
    """The nodes holding the blocks, and the merged ``kv_transfer_params``."""
    holders: list[str] = []
    params: dict[str, Any] | None = None
    writer: dict[str, str] = {}
    for node_id, result in results:
        if result is FAULTED:
            # It may still be saving from these blocks: they stay held until
            # its worker half is switched off (the fault switched it off).
            holders.append(node_id)
            continue
        hold, node_params = result if result is not None else (False, None)
        if hold:
            holders.append(node_id)
        if node_params is None:
            continue
        # "kv_composer" is everyone's: each node writes its own entries in it
        # (kv_composer.retention.<node>), merged; any other key is one node's.
        own = {k: v for k, v in node_params.items() if k != NOTE}
        clash = sorted(set(writer) & set(own))
        if clash:
            raise TransferParamsClash(
                f"kv_transfer_params key(s) {clash} written by node "
                f'"{writer[clash[0]]}" and node "{node_id}"'
            )
        writer.update(dict.fromkeys(own, node_id))
        params = {**(params or {}), **own}
        note = node_params.get(NOTE)
        if isinstance(note, dict):
            merged = params.setdefault(NOTE, {})
            for key, value in note.items():
                old = merged.get(key)
                both = isinstance(old, dict) and isinstance(value, dict)
                merged[key] = {**old, **value} if both else value
    return holders, params
