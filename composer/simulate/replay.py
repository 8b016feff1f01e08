"""The replay: each request of a trace through a model of every node, in arrival order
(the rules are :mod:`composer.simulate`'s)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.plugin_types import resolve_ref
from composer.simulate.results import NodeResult, Result, TenantResult
from composer.simulate.tiers import (
    DEFAULT_BLOCK_SIZE,
    VLLM_CACHE_ID,
    PrefixCacheModel,
    SimKVGroup,
    SimRequest,
    SimulateError,
    TierModel,
)
from composer.trace import MAX_TRACE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS, KeyMaker, TraceRequest


@dataclass
class Started:
    """A request an engine has looked up and loaded, not yet stored (:meth:`Replay.start`)."""

    prompt: int
    keys: list[bytes]
    #: (node model, first unit, units) per range it loaded.
    plan: list[tuple[TierModel, int, int]]
    #: Prompt tokens vLLM's own prefix cache served.
    vllm_tokens: int
    #: Prompt tokens served in all (vLLM's cache and the nodes).
    tokens_served: int
    #: What the tier models were told of it (told again when it is stored).
    arrival: SimRequest


def _label(node: ResolvedNode) -> str:
    if node.plugin.name == "vllm":
        return f"vllm ({getattr(node.config, 'connector', '?')})"
    return str(node.plugin.name)


def simulate(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    *,
    bytes_per_block: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vllm_cache_blocks: int = 0,
    trace_name: str = "<trace>",
    overrides: dict[str, Any] | None = None,
    exact: bool = False,
    groups: Sequence[SimKVGroup] | None = None,
    notes: Sequence[str] = (),
) -> Result:
    """Replay ``trace`` through ``pipeline``; ``overrides`` replaces config fields of
    every modelled node that has them (a sweep's point).

    ``bytes_per_block`` is a tier slot's: every layer's block with one KV cache
    group, one group's block (the largest) with several. ``groups`` are the
    model's KV cache groups (default: one full-attention group of
    ``bytes_per_block``).

    Unless ``exact``, when the block size divides a trace block the replay moves
    whole trace blocks (``trace_block_tokens // block_size`` vLLM blocks, one
    unit): every block of a trace block is looked up, stored, touched and
    evicted together, 16x less work for Mooncake's 512 tokens in 32-token
    blocks. A tier then holds whole units only, and the full blocks of a
    prompt's partial last trace block (never a hit: unique to the request) are
    not stored; a window group keeps only the blocks a hit at a unit's end needs
    (``window_units``). ``exact`` replays every vLLM block, and so does a
    ``window_retention`` inside a trace block (:func:`_unit`)."""
    _check_options(bytes_per_block, block_size, trace_block_tokens, vllm_cache_blocks)
    groups = tuple(groups or (SimKVGroup("attention", bytes_per_block),))
    notes = list(notes)
    unit = unit_for(pipeline, overrides or {}, groups, block_size, trace_block_tokens, exact, notes)
    keymaker = KeyMaker(block_size * unit, trace_block_tokens)
    run = Replay(pipeline, overrides or {}, keymaker, unit, bytes_per_block,
                 vllm_cache_blocks, groups)
    with collector_paused():
        for req in trace:
            run.request(req)
    prompt_total, served_total = run.prompt_total, run.served_total
    return Result(
        trace=trace_name,
        requests=len(trace),
        prompt_tokens=prompt_total,
        block_size=block_size,
        unit_blocks=unit,
        trace_block_tokens=trace_block_tokens,
        bytes_per_block=bytes_per_block,
        load_policy=pipeline.load_policy,
        nodes=run.rows(len(trace)),
        groups=list(groups),
        notes=notes,
        tokens_served=served_total,
        prefill_tokens_computed=prompt_total - served_total,
        fraction_served=served_total / prompt_total if prompt_total else 0.0,
        tenants=run.tenants if any(run.tenants) else {},
    )


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off for a replay: the tiers' indexes grow to millions
    of long-lived objects that form no cycles, which it would otherwise scan again
    and again (a fifth to a quarter of a replay's time, for nothing)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def unit_for(
    pipeline: ResolvedPipeline,
    overrides: dict[str, Any],
    groups: Sequence[SimKVGroup],
    block_size: int,
    trace_block_tokens: int,
    exact: bool,
    notes: list[str],
) -> int:
    """The vLLM blocks a replay of ``pipeline`` moves as one (:func:`_unit`)."""
    return _unit(
        groups, block_size, trace_block_tokens, exact, notes,
        retentions(pipeline, overrides), window_units(pipeline),
    )


def _unit(
    groups: Sequence[SimKVGroup], block_size: int, trace_block_tokens: int, exact: bool,
    notes: list[str], retentions: Sequence[int] = (), splits: bool = False,
) -> int:
    """vLLM blocks replayed as one (a whole trace block where it can be, see :func:`simulate`).

    A hit then ends at a trace block's end. With window groups, every node's
    ``window_retention`` (``retentions``) must be 0 or whole trace blocks: a
    retained hit point inside a trace block would be lost. Models that keep a
    window's own blocks in units (``splits``, :func:`window_units`) take any window;
    others windows of whole trace blocks and no ``window_retention: 0`` (they would
    keep a window at a prompt's end that the real tier keeps only inside its last,
    partial trace block). Otherwise every block is replayed."""
    if exact or trace_block_tokens % block_size:
        return 1
    windows = [g.window for g in groups if g.window]
    if windows and splits:
        if any(n < 0 or n % trace_block_tokens for n in retentions):
            notes.append(
                f"window_retention not a multiple of {trace_block_tokens} tokens (hit points "
                "inside a trace block): every block replayed (as --exact)"
            )
            return 1
    elif windows and any(n <= 0 or n % trace_block_tokens for n in (*windows, *retentions)):
        notes.append(
            f"window groups keep single blocks (a window or window_retention not a positive "
            f"multiple of {trace_block_tokens} tokens): every block replayed (as --exact)"
        )
        return 1
    return trace_block_tokens // block_size


def window_units(pipeline: ResolvedPipeline) -> bool:
    """Whether every modelled node's model keeps a window's own blocks in units
    (``window_units``: given ``unit_blocks``, see :class:`~composer.simulate.TierModel`)."""
    return all(
        getattr(resolve_ref(spec), "window_units", False)
        for node in pipeline.nodes
        if (spec := getattr(node.plugin, "simulator", None)) is not None
    )


def retentions(pipeline: ResolvedPipeline, overrides: dict[str, Any]) -> list[int]:
    """Every modelled node's ``window_retention`` (a sweep's value where it sets it)."""
    out = []
    for node in pipeline.nodes:
        value = getattr(node.config, "window_retention", None)
        if value is None or getattr(node.plugin, "simulator", None) is None:
            continue
        try:
            out.append(int(overrides.get("window_retention", value)))
        except (TypeError, ValueError):
            out.append(1)  # not a number: refused where the node's model is built
    return out


def _check_options(
    bytes_per_block: int, block_size: int, trace_block_tokens: int, vllm_cache_blocks: int
) -> None:
    if bytes_per_block < 1:
        raise SimulateError("bytes per block must be >= 1")
    if block_size < 1:
        raise SimulateError("--block-size must be >= 1")
    if trace_block_tokens < 1:
        raise SimulateError("--trace-block-tokens must be >= 1")
    if vllm_cache_blocks < 0:
        raise SimulateError("--vllm-cache-blocks must be >= 0")
    if trace_block_tokens >= MAX_TRACE_BLOCK_TOKENS:
        raise SimulateError(f"trace block tokens must be < {MAX_TRACE_BLOCK_TOKENS}")


class Replay:
    """One replay's tier models and their rows, moving ``group`` vLLM blocks a unit
    (the keymaker's block size is the unit's tokens)."""

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        overrides: dict[str, Any],
        keymaker: KeyMaker,
        group: int,
        bytes_per_block: int,
        vllm_cache_blocks: int,
        groups: tuple[SimKVGroup, ...],
    ) -> None:
        self.pipeline, self.keymaker, self.group = pipeline, keymaker, group
        self.unit = keymaker.block_size
        unit_bytes = bytes_per_block * group
        unit_groups = tuple(replace(g, block_bytes=g.block_bytes * group) for g in groups)
        self.results: dict[str, NodeResult] = {}
        self.models: dict[str, TierModel] = {}
        #: vLLM blocks in each model's counts (a unit; one block for a model in rings).
        self.counts: dict[str, int] = {}
        for node in pipeline.nodes:
            self._add_node(node, overrides, unit_bytes, unit_groups)
        self.vllm_blocks = vllm_cache_blocks
        self.vllm = PrefixCacheModel(vllm_cache_blocks // self.group)
        self.vllm_res = NodeResult(VLLM_CACHE_ID, "vllm prefix cache", modelled=True)
        self.vllm_res.lookup = self.vllm_res.save = vllm_cache_blocks > 0
        self.vllm_res.capacity_blocks = self.vllm.capacity_blocks * self.group
        self.vllm_res.capacity_bytes = self.vllm.capacity_blocks * unit_bytes
        models, results = self.models, self.results
        self.lookup_nodes = [(models[n], results[n]) for n in pipeline.load_order if n in models]
        self.save_nodes = [(models[n], results[n]) for n in pipeline.save_to if n in models]
        self.longest = pipeline.load_policy == "longest_hit"
        self.prompt_total = self.served_total = 0
        self.tenants: dict[str, TenantResult] = {}

    def _add_node(
        self,
        node: ResolvedNode,
        overrides: dict[str, Any],
        unit_bytes: int,
        groups: tuple[SimKVGroup, ...],
    ) -> None:
        spec = getattr(node.plugin, "simulator", None)
        res = NodeResult(node.id, _label(node), modelled=spec is not None)
        res.lookup = node.id in self.pipeline.load_order
        res.save = node.id in self.pipeline.save_to
        self.results[node.id] = res
        if spec is None:
            return
        config = _with_overrides(node, overrides)
        model_class = cast(Callable[..., TierModel], resolve_ref(spec))
        extra: dict[str, int] = {}
        windows = any(g.window for g in groups)
        if self.group > 1 and windows and getattr(model_class, "window_units", False):
            extra["unit_blocks"] = self.group  # it counts vLLM blocks
        model = model_class(
            config, block_size=self.unit, bytes_per_block=unit_bytes, groups=groups, **extra
        )
        self.models[node.id] = model
        count = self.counts[node.id] = 1 if extra else self.group
        res.capacity_blocks = model.capacity_blocks * count
        res.capacity_bytes = model.capacity_blocks * count * unit_bytes // self.group

    def units(self, req: TraceRequest) -> tuple[int, list[bytes], int]:
        """The request's prompt tokens, its units' keys, and how many may be served."""
        keymaker = self.keymaker
        prompt = keymaker.prompt_tokens(req)
        total = prompt + keymaker.scale(req.output_length)
        # KV exists for every token but the last sampled one.
        keys = keymaker.keys(req, max(prompt, total - 1))
        return prompt, keys, (prompt - 1) // self.unit

    def holds(self, keys: Sequence[bytes], limit: int) -> tuple[int, int]:
        """Leading units vLLM's prefix cache holds, and how many more a node holds after
        them (the longest of the lookup nodes): what a router that reads this engine's
        KV events sees. Changes nothing."""
        start = self.vllm.lookup(keys, 0, limit) if self.vllm_blocks else 0
        more = max((m.lookup(keys, start, limit) for m, _ in self.lookup_nodes), default=0)
        return start, more

    def request(self, req: TraceRequest) -> None:
        self.finish(self.start(*self.units(req), req))

    def start(
        self, prompt: int, keys: list[bytes], limit: int, req: TraceRequest,
        now_s: float | None = None,
    ) -> Started:
        """A request's lookups and loads (what it finds when the engine schedules it, at
        ``now_s``: its trace time by default); :meth:`finish` stores it. Between the two
        other requests may run (a fleet's engine serves several at once)."""
        self.prompt_total += prompt
        when = req.timestamp_ms / 1000.0 if now_s is None else now_s
        arrival = SimRequest(req.tenant, req.retention, when)
        for model in self.models.values():
            model.arrive(arrival)
        start = self._vllm_hit(keys, limit)
        plan = self._load(keys, start, limit)
        served = start + sum(hit for _, _, hit in plan)
        unit = self.unit
        self.served_total += served * unit
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            tenant = self.tenants[req.tenant] = TenantResult()
        tenant.requests += 1
        tenant.prompt_tokens += prompt
        tenant.tokens_served += served * unit
        return Started(prompt, keys, plan, start * unit, served * unit, arrival)

    def finish(self, started: Started) -> None:
        """The request's blocks stored: into vLLM's own cache and every ``save_to`` node
        (each model told again whose they are: others may have arrived since)."""
        keys, plan = started.keys, started.plan
        if self.vllm_blocks:
            self.vllm.finish(keys)
        served = started.tokens_served // self.unit
        for model, res in self.save_nodes:
            model.arrive(started.arrival)
            loaded = [(s, s + hit) for m, s, hit in plan if m is not model]
            res.blocks_saved += model.save(keys, started.prompt, served, loaded) * self.counts[
                res.id
            ]

    def _vllm_hit(self, keys: Sequence[bytes], limit: int) -> int:
        """Leading units vLLM's own prefix cache serves."""
        res = self.vllm_res
        start = self.vllm.lookup(keys, 0, limit) if self.vllm_blocks else 0
        if start:
            res.hits += 1
            res.served_requests += 1
            res.tokens_served += start * self.unit
        res.lookups += self.vllm_blocks > 0
        return start

    def _load(
        self, keys: Sequence[bytes], start: int, limit: int
    ) -> list[tuple[TierModel, int, int]]:
        """What ``load_policy`` loads after ``start``: (node, first unit, units) per range."""
        ranges = self.pipeline.load_policy == "ranges"
        plan: list[tuple[TierModel, NodeResult, int, int]] = []
        at = start
        for model, res in self.lookup_nodes:
            res.lookups += 1
            hit = model.lookup(keys, at, limit)
            if hit <= 0:
                continue
            res.hits += 1
            if ranges:
                plan.append((model, res, at, hit))
                at += hit
            elif not plan or (self.longest and hit > plan[0][3]):
                plan = [(model, res, start, hit)]
        for model, res, first, hit in plan:
            model.load(keys, first, hit)
            res.served_requests += 1
            res.tokens_served += hit * self.unit
            res.blocks_loaded += hit * self.group
        return [(model, first, hit) for model, _, first, hit in plan]

    def rows(self, requests: int) -> list[NodeResult]:
        """Every row, vLLM's prefix cache first (when modelled), in vLLM blocks and bytes."""
        for node_id, model in self.models.items():
            res = self.results[node_id]
            res.evictions = model.evictions * self.counts[node_id]
            res.bytes_loaded, res.bytes_saved = model.bytes_loaded, model.bytes_saved
            res.bytes_saved_per_request = res.bytes_saved / requests if requests else 0.0
            res.window_saving = model.window_saving
            res.note = model.disabled_reason or ""
            # (Optional in a model: one without cache policies has neither.)
            res.policies = dict(getattr(model, "policies", None) or {})
            res.policy_fallbacks = list(getattr(model, "policy_fallbacks", None) or [])
        self.vllm_res.evictions = self.vllm.evictions * self.group
        nodes = [self.vllm_res] if self.vllm_blocks else []
        nodes += [self.results[n.id] for n in self.pipeline.nodes]
        prompt_total = self.prompt_total
        for res in nodes:
            res.fraction_served = res.tokens_served / prompt_total if prompt_total else 0.0
        return nodes


def _with_overrides(node: ResolvedNode, overrides: dict[str, Any]) -> BaseModel:
    fields = {k: v for k, v in overrides.items() if k in type(node.config).model_fields}
    if not fields:
        return node.config
    data = node.config.model_dump()
    data.update(fields)
    try:
        return type(node.config).model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SimulateError(
            f"--sweep: node {node.id!r}: {'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from None
