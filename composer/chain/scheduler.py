"""Scheduler side: routing a request to the node that serves it, and holding its blocks.

The load policy picks one node per request (first or longest hit, in load
order); only that node is told it loads. Which blocks it loads travels to the
workers with the step's metadata, so a failing load there becomes load errors.
What the node served is settled by what vLLM reports back (:class:`PlannedLoad`):
only the tokens that arrived count, in ``served_by`` and in the node's counters.
A finished request's blocks stay held while any node still saves from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from composer.chain.base import ChainBase
from composer.chain.calls import Call
from composer.chain.metadata import ChainMetadata, TransferParamsClash
from composer.kv_caches import NULL_BLOCK
from composer.pipeline import ResolvedNode
from composer.views import RequestView, StepView

#: What a request_finished call that raised stands for.
FAULTED = object()


@dataclass
class PlannedLoad:
    """A request's load as planned, and what arrived of it.

    vLLM reports a load's failure back to the scheduler: a sync load's (and an
    async one's) failed blocks as ``invalid_block_ids``, and it recomputes from
    the first of them on; an async load that failed as a whole (several KV
    cache groups, or a node switched off) in ``failed_recving``. Every
    failure path of the chain ends there (a node's fault, its store away, a
    checksum refusal, a switch-off: their blocks are load errors)."""

    node: str
    #: The request's computed tokens before the load, and the tokens it loads.
    computed: int
    tokens: int
    #: Per KV cache group, the blocks the load writes, in order (from block
    #: ``computed // block_size``; null blocks of a sliding window included).
    blocks: tuple[tuple[int, ...], ...]
    #: Tokens that arrived: the planned ones until a failure is reported.
    delivered: int = field(init=False)

    def __post_init__(self) -> None:
        self.delivered = self.tokens

    def failed(self, invalid: set[int], block_size: int) -> None:
        """``invalid`` blocks failed: vLLM recomputes from the first the load wrote."""
        first = self.computed // block_size if block_size else 0
        for group in self.blocks:
            for i, block in enumerate(group):
                if block != NULL_BLOCK and block in invalid:
                    kept = max(0, (first + i) * block_size - self.computed)
                    self.delivered = min(self.delivered, kept)
                    break


class SchedulerSide(ChainBase):
    """The scheduler half's hooks: each a method looping over its call list."""

    #: ``build_connector_meta``'s calls: with the step view and vLLM's output when
    #: some node names the step view, else with what each hookimpl names.
    meta_calls: list[tuple[str, Call]]
    meta_wants_step: bool

    def _bind_scheduler(self) -> None:
        if "step" in self.lists.wanted["build_connector_meta"]:
            self.meta_wants_step, self.meta_calls = True, self.calls["build_connector_meta"]
        else:
            # No node names it: none is built (a view per step costs).
            self.meta_wants_step = False
            self.meta_calls = [
                (node_id, fn if argnames else _dropping_args(fn))
                for node_id, fn, argnames in self.lists.own["build_connector_meta"]
            ]

    # -- per step ----------------------------------------------------------------- #

    def build_connector_meta(self, scheduler_output: Any) -> ChainMetadata:
        """Each node's metadata for its worker half, with what the workers must follow."""
        per_node, calls = {}, self.meta_calls
        # Two loops, so that the usual step builds no argument tuple.
        if self.meta_wants_step:
            step = StepView(scheduler_output)
            for node_id, fn in calls:
                try:
                    per_node[node_id] = fn(step, scheduler_output)
                except Exception as exc:
                    self.fault(node_id, "build_connector_meta", exc)
                    per_node[node_id] = None
        else:
            for node_id, fn in calls:
                try:
                    per_node[node_id] = fn(scheduler_output)
                except Exception as exc:
                    self.fault(node_id, "build_connector_meta", exc)
                    per_node[node_id] = None
        meta = self.metadata_type(per_node, None, self.pending_loads)
        self.pending_loads = {}
        if self.new_holds or self.new_async_loads or self.disabled or self.new_group_loads:
            self._step_decisions(meta)
        return meta

    def has_pending_block_frees(self) -> bool:
        return self._any_true("has_pending_block_frees")

    def has_pending_push_work(self) -> bool:
        return self._any_true("has_pending_push_work")

    def _any_true(self, hook: str) -> bool:
        found = False  # every node is asked, as with any()
        for node_id, fn in self.calls[hook]:
            try:
                if fn():
                    found = True
            except Exception as exc:
                self.fault(node_id, hook, exc)
        return found

    def _step_decisions(self, meta: ChainMetadata) -> None:
        """What the workers must follow this step: holds, async loads, switch-offs."""
        if self.new_holds:
            meta.holds, self.new_holds = self.new_holds, {}
        if self.new_async_loads:
            meta.async_loads, self.new_async_loads = self.new_async_loads, {}
        if self.disabled:
            meta.disabled = frozenset(self.disabled)
        if self.new_group_loads:
            meta.group_loads, self.new_group_loads = self.new_group_loads, {}

    # -- once ------------------------------------------------------------------ #

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.results("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.results("bind_gpu_block_pool", gpu_block_pool)

    # -- per request ------------------------------------------------------------ #

    def on_new_request(self, request: Any) -> None:
        self.results("on_new_request", RequestView(request))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        view = RequestView(request)
        longest = self.pipeline.load_policy == "longest_hit"
        chosen: tuple[str, int, bool] | None = None
        for node_id, fn in self.calls["get_num_new_matched_tokens"]:
            tokens, load_async = self._lookup(node_id, fn, view, num_computed_tokens)
            if tokens is None:
                # Still looking up: vLLM asks again later (MultiConnector's rule).
                return None, False
            if tokens > 0:
                self.stats[node_id].hits += 1
                if chosen is None or (longest and tokens > chosen[1]):
                    chosen = (node_id, tokens, load_async)
        if chosen is None:
            self.chosen.pop(view.request_id, None)
            return 0, False
        load_async = chosen[2]
        if self.num_groups > 1 and not load_async:
            # vLLM takes failed loads of several groups only per request, from
            # async loads: the node loads as it likes, the chain reports it done.
            self.converted.add(view.request_id)
            load_async = True
        self.chosen[view.request_id] = (chosen[0], num_computed_tokens, load_async)
        return chosen[1], load_async

    def _lookup(
        self, node_id: str, fn: Callable[..., Any], view: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.stats[node_id].lookups += 1
        try:
            tokens, load_async = fn(view, num_computed_tokens)
        except Exception as exc:
            self.fault(node_id, "get_num_new_matched_tokens", exc)
            return 0, False
        if node_id in self.outages:
            self.store_back(node_id)
        return tokens, load_async

    def chosen_node(self, request_id: str) -> str | None:
        entry = self.chosen.get(request_id)
        return entry[0] if entry else None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        view = RequestView(request)
        chosen = self.chosen_node(view.request_id)
        block_ids = blocks.get_block_ids() if blocks is not None else ()
        if chosen is not None and num_external_tokens > 0:
            self._plan_load(view.request_id, chosen, block_ids, num_external_tokens)
        if not getattr(request, "num_preemptions", 0):
            # Once per request, at its admission (as vLLM counts its external prefix
            # cache hits): vLLM asks again about a request it could not schedule yet.
            # What a node served is counted when the request finishes: settled.
            for node_id, _ in self.calls["get_num_new_matched_tokens"]:
                self.stats[node_id].count_request(view.num_prompt_tokens)
        for node_id, fn in self.calls["update_state_after_alloc"]:
            tokens = num_external_tokens if node_id == chosen else 0
            try:
                fn(view, block_ids, tokens, blocks)
            except Exception as exc:
                self.fault(node_id, "update_state_after_alloc", exc)

    def _plan_load(
        self, request_id: str, node_id: str, block_ids: Any, num_external_tokens: int
    ) -> None:
        """Record which blocks ``node_id`` loads, for the workers' load errors and
        for settling what it served."""
        _, computed, load_async = self.chosen[request_id]
        size = self.block_size
        first = computed // size if size else 0
        last = -(-(computed + num_external_tokens) // size) if size else None
        ordered = tuple(tuple(group[first:last]) for group in block_ids)
        self.served[request_id] = PlannedLoad(node_id, computed, num_external_tokens, ordered)
        loading = self.pending_loads.setdefault(node_id, set())
        blocks = {b for group in ordered for b in group if b != NULL_BLOCK}
        loading |= blocks
        if self.num_groups > 1:
            converted = request_id in self.converted
            self.converted.discard(request_id)
            self.new_group_loads[request_id] = (node_id, frozenset(blocks), converted)
            if converted:
                return  # the chain reports it finished, not the node
        if load_async:
            # Async: the worker tracks it, so that a node switched off before
            # it finishes loading reports it failed instead of leaving it waiting.
            self.new_async_loads[request_id] = node_id

    def settle_loads(self, invalid_block_ids: set[int], failed_recving: set[str]) -> None:
        """Loads vLLM reported failed (from ``update_connector_output``)."""
        for request_id, load in self.served.items():
            if request_id in failed_recving:
                load.delivered = 0
            elif invalid_block_ids:
                load.failed(invalid_block_ids, self.block_size)

    def ask_chosen(self, hook: str, request: Any, *args: Any) -> Any:
        """Ask only the node serving ``request``; None when it has no answer."""
        chosen = self.chosen_node(request.request_id)
        for node_id, fn in self.calls[hook]:
            if node_id == chosen:
                try:
                    return fn(RequestView(request), *args)
                except Exception as exc:
                    self.fault(node_id, hook, exc)
        return None

    # -- finishing -------------------------------------------------------------- #

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        view = RequestView(request)
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
        view = RequestView(request)
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
                away = self.fault(node_id, hook, exc)
                results.append((node_id, None if away else FAULTED))
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
        if holders:
            self.new_holds[request.request_id] = tuple(holders)
        load = self.served.pop(request.request_id, None)
        delivered = self._settle(load) if load is not None else 0
        if self.pipeline.annotate_outputs:
            note: dict[str, Any] = {
                "served_by": load.node if load is not None and delivered else None,
                "tokens": delivered,
            }
            if load is not None and delivered < load.tokens:
                note["failed"] = {"node": load.node, "tokens": load.tokens - delivered}
            params = {**(params or {}), "kv_composer": note}
        self.chosen.pop(request.request_id, None)
        return bool(holders), params

    def _settle(self, load: PlannedLoad) -> int:
        """Count what ``load`` delivered on its node's stats; returns the tokens."""
        stats, delivered = self.stats[load.node], load.delivered
        stats.tokens_hit += delivered
        if delivered:
            stats.count_served(delivered)
        if delivered < load.tokens:
            stats.extra.add("loads_failed")
            stats.extra.add("tokens_load_failed", load.tokens - delivered)
        return delivered

    def register_finished_partial_tail(self, request: Any, block_ids: Any, offloads: Any) -> bool:
        view = RequestView(request)
        results = self.results(
            "register_finished_partial_tail", view, block_ids, offloads, default=False
        )
        return any(r for _, r in results)

    def get_finished_count(self) -> int | None:
        counts = [c for _, c in self.results("get_finished_count")]
        if not counts or any(c is None for c in counts):
            return None
        if len(set(counts)) > 1:
            raise ValueError(f"nodes returned incompatible finished counts: {sorted(set(counts))}")
        return counts[0]


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
        clash = sorted(set(writer) & set(node_params))
        if clash:
            raise TransferParamsClash(
                f"kv_transfer_params key(s) {clash} written by node "
                f'"{writer[clash[0]]}" and node "{node_id}"'
            )
        writer.update(dict.fromkeys(node_params, node_id))
        params = {**(params or {}), **node_params}
    return holders, params


def _dropping_args(fn: Call) -> Call:
    """``fn`` (a hookimpl naming no argument) called with vLLM's."""
    return lambda *args: fn()
