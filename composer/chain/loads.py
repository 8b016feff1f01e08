"""Load planning: which nodes serve a request, each for which tokens, and what arrived.

The load policy plans a request's load as ranges of tokens, each from one node
(:class:`~composer.ranges.Range`): ``first_hit`` and ``longest_hit`` pick one node (the first, or
the longest hit, in load order); ``ranges`` asks each node in load order for
what it holds after the previous nodes' hits, so ``[0, a)`` comes from the
first node holding it, ``[a, b)`` from the next, and vLLM computes the rest.
Each node is told only its own range. Which blocks it loads travels to the
workers with the step's metadata, so a failing load there becomes load errors.
What the node served is settled by what vLLM reports back: only the tokens
that arrived count (:attr:`~composer.ranges.Range.delivered`), in ``served_by`` and in the
node's counters.

:class:`LoadPlanning` is the scheduler chain's part that does this, with the
state of requests from their lookup to their finish (when
:class:`~composer.chain.holds.BlockHolding` takes what they were served). It
is mixed into :class:`~composer.chain.scheduler.SchedulerChain`, so vLLM's call
reaches its method directly; what it uses of the chain is listed in its body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from composer.chain.calls import Call
from composer.chain.faults import Outage
from composer.controls import unknown_names
from composer.pipeline import ResolvedPipeline
from composer.ranges import Range
from composer.stats import NodeStats
from composer.views import RequestView, RequestViews


def settle_ranges(loads: list[Range]) -> None:
    """vLLM recomputes a request from its first failed token on: ranges after a
    failed one arrived in vain."""
    failed = [x.start + x.delivered for x in loads if x.delivered < x.tokens]
    if failed:
        position = min(failed)
        for load in loads:
            load.cut(position)


@dataclass(slots=True)
class LoadState:
    """What the scheduler keeps of requests' loads, from their lookup to their finish."""

    block_size: int
    #: Request -> its load's ranges as looked up, in order (one per node serving it).
    plans: dict[str, list[Range]] = field(default_factory=dict)
    #: Request -> its load's ranges as vLLM allocated them, settled as they arrive.
    loads_of: dict[str, list[Range]] = field(default_factory=dict)
    #: Node -> the blocks it loads this step (sent with the step's metadata).
    step_load_blocks: dict[str, set[int]] = field(default_factory=dict)
    #: Request -> why its tier controls were refused (told in its kv_transfer_params).
    refused: dict[str, str] = field(default_factory=dict)
    #: Request -> its ranges, when its load is async for vLLM (see
    #: ``ChainMetadata.async_loads``): sent with the next step's metadata.
    async_loads_to_send: dict[str, tuple[Range, ...]] = field(default_factory=dict)
    #: Requests with a sync range the chain made async for vLLM (several groups, or
    #: ranges of both kinds).
    made_async: set[str] = field(default_factory=set)


class LoadPlanning:
    """The scheduler's lookups and loads (the hooks asked per request before it runs)."""

    # What it uses of the chain (:class:`~composer.chain.core.ChainCore`'s, and the
    # scheduler chain's request views): nothing else.
    if TYPE_CHECKING:
        pipeline: ResolvedPipeline
        calls: dict[str, list[tuple[str, Call]]]
        stats: dict[str, NodeStats]
        outages: dict[str, Outage]
        num_groups: int
        log: Any
        views: RequestViews

        def fault(self, node_id: str, hook: str, exc: BaseException) -> None: ...
        def store_back(self, node_id: str) -> None: ...

    def _init_loads(self, block_size: int) -> None:
        # One member for the part's state: a chain with more than 30 instance
        # attributes loses CPython's shared-key dict, and every ``self.x`` of the
        # scheduler's per-step calls gets slower (make bench's dispatch saw +8 %).
        self.loading = LoadState(block_size)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        view = self.views.of(request)
        if self.pipeline.load_policy == "ranges":
            plan = self._plan_ranges(view, num_computed_tokens)
        else:
            plan = self._plan_one(view, num_computed_tokens)
        if plan is None:
            # Still looking up: vLLM asks again later (MultiConnector's rule).
            return None, False
        rid = view.request_id
        self.loading.made_async.discard(rid)  # (vLLM may ask again: the last answer counts)
        if not plan:
            self.loading.plans.pop(rid, None)
            return 0, False
        self.loading.plans[rid] = plan
        load_async = any(r.load_async for r in plan)
        if self.num_groups > 1 and not load_async:
            # vLLM takes failed loads of several groups only per request, from
            # async loads: the node loads as it likes, the chain reports it done.
            load_async = True
        if load_async and not all(r.load_async for r in plan):
            # Sync ranges of an async load: the chain reports them done.
            self.loading.made_async.add(rid)
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
        if error is not None and view.request_id not in self.loading.refused:
            self.loading.refused[view.request_id] = error
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

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        view = self.views.of(request)
        rid = view.request_id
        block_ids = blocks.get_block_ids() if blocks is not None else ()
        tokens: dict[str, int] = {}
        view.loads = ()  # (vLLM allocates again after a preemption: this load only)
        if num_external_tokens > 0 and rid in self.loading.plans:
            view.loads = self._allocate(rid, block_ids, num_external_tokens)
            tokens = {r.node: r.tokens for r in view.loads}
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

    def _allocate(
        self, request_id: str, block_ids: Any, num_external_tokens: int
    ) -> tuple[Range, ...]:
        """The planned ranges as vLLM allocated them (its tokens cut to what it took),
        each with the blocks its node loads (for the workers' load errors and for
        settling what it served)."""
        plan = self.loading.plans[request_id]
        size, left = self.loading.block_size, num_external_tokens
        made_async = request_id in self.loading.made_async
        self.loading.made_async.discard(request_id)
        loads: list[Range] = []
        for r in plan:
            tokens = min(r.tokens, left)
            if tokens <= 0:
                break
            left -= tokens
            first = r.start // size if size else 0
            last = -(-(r.start + tokens) // size) if size else None
            blocks = tuple(tuple(group[first:last]) for group in block_ids)
            load = replace(
                r, tokens=tokens, blocks=blocks, reported_by_chain=made_async and not r.load_async
            )
            self.loading.step_load_blocks.setdefault(r.node, set()).update(load.block_ids())
            loads.append(load)
        self.loading.loads_of[request_id] = loads
        if self.num_groups > 1 or made_async or any(r.load_async for r in plan):
            # Async for vLLM: the workers track it, so that it is reported done when
            # every range is, and failed when one is (or its node is switched off).
            self.loading.async_loads_to_send[request_id] = tuple(loads)
        return tuple(loads)

    def settle_loads(self, invalid_block_ids: set[int], failed_recving: set[str]) -> None:
        """Loads vLLM reported failed (from ``update_connector_output``)."""
        for request_id, loads in self.loading.loads_of.items():
            for load in loads:
                if request_id in failed_recving:
                    load.delivered = 0
                elif invalid_block_ids:
                    load.failed(invalid_block_ids, self.loading.block_size)
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

    def _ask_chosen(self, hook: str, request: Any, *args: Any) -> Any:
        """Ask only the nodes serving ``request`` (one per range); None when none answers.

        Several ranges: each node is asked about its own tokens (the hit sources'
        counts are summed, the KV cache groups united)."""
        plan = self.loading.plans.get(request.request_id) or []
        fns = dict(self.calls[hook])
        answers = []
        for r in plan:
            fn = fns.get(r.node)
            if fn is None:
                continue
            own = (r.tokens, *args[1:]) if args and len(plan) > 1 else args
            try:
                answer = fn(self.views.of(request), *own)
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

    def loads_finished(self, request_id: str) -> tuple[list[Range], str | None]:
        """The request finished: what it was served, and why its tier controls were
        refused (if they were); its load is forgotten."""
        self.loading.plans.pop(request_id, None)
        return self.loading.loads_of.pop(request_id, []), self.loading.refused.pop(request_id, None)
