"""Scheduler side: routing a request to the nodes that serve it, and holding its blocks.

The load policy plans a request's load as ranges of tokens, each from one node
(:class:`Range`): ``first_hit`` and ``longest_hit`` pick one node (the first, or
the longest hit, in load order); ``ranges`` asks each node in load order for
what it holds after the previous nodes' hits, so ``[0, a)`` comes from the
first node holding it, ``[a, b)`` from the next, and vLLM computes the rest.
Each node is told only its own range. Which blocks it loads travels to the
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
from composer.chain.calls import Call, adapt
from composer.chain.metadata import ChainMetadata, TransferParamsClash
from composer.controls import unknown_names
from composer.kv_caches import NULL_BLOCK
from composer.pipeline import ResolvedNode
from composer.views import RequestView, StepView

#: What a request_finished call that raised stands for.
FAULTED = object()


@dataclass(frozen=True)
class Range:
    """One node's part of a request's load: ``tokens`` tokens after ``start``."""

    node: str
    #: The computed tokens the node was asked from (vLLM's, or the previous ranges' end).
    start: int
    tokens: int
    load_async: bool


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
    #: The computed tokens before this node's range, and the tokens it loads.
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

    def cut(self, position: int) -> None:
        """vLLM recomputes from token ``position`` on (an earlier range failed there)."""
        self.delivered = min(self.delivered, max(0, position - self.computed))


def settle_ranges(loads: list[PlannedLoad]) -> None:
    """vLLM recomputes a request from its first failed token on: ranges after a
    failed one arrived in vain."""
    failed = [x.computed + x.delivered for x in loads if x.delivered < x.tokens]
    if failed:
        position = min(failed)
        for load in loads:
            load.cut(position)


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
                (node_id, adapt(fn, argnames, ("scheduler_output",)))
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
        if self.new_holds or self.new_async_loads or self.disabled:
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
        if self.pipeline.load_policy == "ranges":
            plan = self._plan_ranges(view, num_computed_tokens)
        else:
            plan = self._plan_one(view, num_computed_tokens)
        if plan is None:
            # Still looking up: vLLM asks again later (MultiConnector's rule).
            return None, False
        rid = view.request_id
        self.converted.discard(rid)  # (vLLM may ask again: the last answer counts)
        if not plan:
            self.chosen.pop(rid, None)
            return 0, False
        self.chosen[rid] = plan
        load_async = any(r.load_async for r in plan)
        if self.num_groups > 1 and not load_async:
            # vLLM takes failed loads of several groups only per request, from
            # async loads: the node loads as it likes, the chain reports it done.
            load_async = True
        if load_async and not all(r.load_async for r in plan):
            # Sync ranges of an async load: the chain reports them done.
            self.converted.add(rid)
        return sum(r.tokens for r in plan), load_async

    def _plan_one(self, view: RequestView, num_computed_tokens: int) -> list[Range] | None:
        """first_hit / longest_hit: every node is asked; one serves."""
        longest = self.pipeline.load_policy == "longest_hit"
        chosen: Range | None = None
        allowed = self.load_allowed(view)
        for node_id, fn in self.calls["get_num_new_matched_tokens"]:
            tokens, load_async = self._lookup(node_id, fn, view, num_computed_tokens, allowed)
            if tokens is None:
                return None
            if tokens > 0:
                self.stats[node_id].hits += 1
                if chosen is None or (longest and tokens > chosen.tokens):
                    chosen = Range(node_id, num_computed_tokens, tokens, load_async)
        return [chosen] if chosen is not None else []

    def _plan_ranges(self, view: RequestView, num_computed_tokens: int) -> list[Range] | None:
        """ranges: each node, in load order, is asked for what it holds after the
        ranges before it; a node's hit extends the load by its own range."""
        plan: list[Range] = []
        start = num_computed_tokens
        allowed = self.load_allowed(view)
        for node_id, fn in self.calls["get_num_new_matched_tokens"]:
            tokens, load_async = self._lookup(node_id, fn, view, start, allowed)
            if tokens is None:
                return None
            if tokens > 0:
                self.stats[node_id].hits += 1
                plan.append(Range(node_id, start, tokens, load_async))
                start += tokens
        return plan

    def load_allowed(self, view: RequestView) -> frozenset[str] | None:
        """The nodes the request may load from (its ``kv_load_tiers``); None: any.

        What is wrong with its controls (:mod:`composer.controls`) is said in the
        request's finished ``kv_transfer_params``."""
        if not view.kv_transfer_params:
            return None
        controls = view.controls
        error = unknown_names(controls, [n.id for n in self.pipeline.nodes])
        if error is not None and view.request_id not in self.refused:
            self.refused[view.request_id] = error
            self.log.warning("request's tier controls", request=view.request_id, error=error)
        return controls.load

    def _lookup(
        self,
        node_id: str,
        fn: Callable[..., Any],
        view: RequestView,
        num_computed_tokens: int,
        allowed: frozenset[str] | None,
    ) -> tuple[int | None, bool]:
        """The node's hit; a node the request may not load from (``allowed``) is
        still asked, as vLLM's connector API expects of every connector before
        ``update_state_after_alloc`` (LMCache's keeps the request's state from its
        lookup), and its hit counts as none."""
        self.stats[node_id].lookups += 1
        try:
            tokens, load_async = fn(view, num_computed_tokens)
        except Exception as exc:
            self.fault(node_id, "get_num_new_matched_tokens", exc)
            return 0, False
        if node_id in self.outages:
            self.store_back(node_id)
        if allowed is not None and node_id not in allowed and tokens is not None:
            return 0, False
        return tokens, load_async

    def chosen_node(self, request_id: str) -> str | None:
        """The node serving the request's first range."""
        plan = self.chosen.get(request_id)
        return plan[0].node if plan else None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        view = RequestView(request)
        rid = view.request_id
        block_ids = blocks.get_block_ids() if blocks is not None else ()
        tokens: dict[str, int] = {}
        if num_external_tokens > 0 and rid in self.chosen:
            tokens = self._plan_loads(rid, block_ids, num_external_tokens)
            view.loads = tuple((x.node, x.computed, x.tokens) for x in self.served[rid])
        if not getattr(request, "num_preemptions", 0):
            # Once per request, at its admission (as vLLM counts its external prefix
            # cache hits): vLLM asks again about a request it could not schedule yet.
            # What a node served is counted when the request finishes: settled.
            for node_id, _ in self.calls["get_num_new_matched_tokens"]:
                self.stats[node_id].count_request(view.num_prompt_tokens)
        for node_id, fn in self.calls["update_state_after_alloc"]:
            try:
                fn(view, block_ids, tokens.get(node_id, 0), blocks)
            except Exception as exc:
                self.fault(node_id, "update_state_after_alloc", exc)

    def _plan_loads(
        self, request_id: str, block_ids: Any, num_external_tokens: int
    ) -> dict[str, int]:
        """Record which blocks each range's node loads (for the workers' load
        errors and for settling what it served); returns each node's tokens."""
        plan = self.chosen[request_id]
        size, left = self.block_size, num_external_tokens
        converted = request_id in self.converted
        self.converted.discard(request_id)
        loads: list[PlannedLoad] = []
        ranges: list[tuple[str, frozenset[int], bool]] = []
        for r in plan:
            tokens = min(r.tokens, left)
            if tokens <= 0:
                break
            left -= tokens
            first = r.start // size if size else 0
            last = -(-(r.start + tokens) // size) if size else None
            ordered = tuple(tuple(group[first:last]) for group in block_ids)
            loads.append(PlannedLoad(r.node, r.start, tokens, ordered))
            blocks = frozenset(b for group in ordered for b in group if b != NULL_BLOCK)
            self.pending_loads.setdefault(r.node, set()).update(blocks)
            ranges.append((r.node, blocks, converted and not r.load_async))
        self.served[request_id] = loads
        if self.num_groups > 1 or converted or any(r.load_async for r in plan):
            # Async for vLLM: the workers track it, so that it is reported done when
            # every range is, and failed when one is (or its node is switched off).
            self.new_async_loads[request_id] = tuple(ranges)
        return {load.node: load.tokens for load in loads}

    def settle_loads(self, invalid_block_ids: set[int], failed_recving: set[str]) -> None:
        """Loads vLLM reported failed (from ``update_connector_output``)."""
        for request_id, loads in self.served.items():
            for load in loads:
                if request_id in failed_recving:
                    load.delivered = 0
                elif invalid_block_ids:
                    load.failed(invalid_block_ids, self.block_size)
            if len(loads) > 1:
                settle_ranges(loads)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...] | None:
        """The KV cache groups the request's load restores (None: vLLM's default)."""
        return self._ask_chosen("get_loaded_kv_cache_group_ids", request)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int] | None:
        """The loaded tokens by cache source (None: vLLM's default)."""
        return self._ask_chosen("get_external_cache_hit_sources", request, num_external_tokens)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.results("set_xfer_handshake_metadata", metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.results("set_xfer_handshake_metadata_pp_aware", metadata)

    def _ask_chosen(self, hook: str, request: Any, *args: Any) -> Any:
        """Ask only the nodes serving ``request`` (one per range); None when none answers.

        Several ranges: each node is asked about its own tokens (the hit sources'
        counts are summed, the KV cache groups united)."""
        plan = self.chosen.get(request.request_id) or []
        fns = dict(self.calls[hook])
        answers = []
        for r in plan:
            fn = fns.get(r.node)
            if fn is None:
                continue
            own = (r.tokens, *args[1:]) if args and len(plan) > 1 else args
            try:
                answer = fn(RequestView(request), *own)
            except Exception as exc:
                self.fault(r.node, hook, exc)
                continue
            if answer is not None:
                answers.append(answer)
        if len(answers) <= 1:
            return answers[0] if answers else None
        if isinstance(answers[0], dict):
            summed: dict[Any, int] = {}
            for answer in answers:
                for key, n in answer.items():
                    summed[key] = summed.get(key, 0) + n
            return summed
        return tuple(sorted({g for answer in answers for g in answer}))

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
        loads = self.served.pop(request.request_id, [])
        for load in loads:
            self._settle(load)
        refused = self.refused.pop(request.request_id, None)
        if self.pipeline.annotate_outputs or refused:
            note = self._note(loads) if self.pipeline.annotate_outputs else {}
            if refused:
                note["error"] = f"tier controls: {refused}"
            params = {**(params or {}), "kv_composer": note}
        self.chosen.pop(request.request_id, None)
        return bool(holders), params

    def _note(self, loads: list[PlannedLoad]) -> dict[str, Any]:
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
                {"node": x.node, "start": x.computed, "tokens": x.delivered} for x in loads
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

    def _settle(self, load: PlannedLoad) -> None:
        """Count what ``load`` delivered on its node's stats."""
        stats, delivered = self.stats[load.node], load.delivered
        stats.tokens_hit += delivered
        if delivered:
            stats.count_served(delivered)
        if delivered < load.tokens:
            stats.extra.add("loads_failed")
            stats.extra.add("tokens_load_failed", load.tokens - delivered)

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
