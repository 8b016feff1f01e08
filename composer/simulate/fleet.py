"""``kvc simulate --fleet N --router POLICY``: a trace through N engines behind a router, in time.

Each engine is a replay of its own (:class:`composer.simulate.replay.Replay`:
its vLLM prefix cache and its nodes' models). Requests arrive at the trace's
timestamps (divided by ``speedup``), or, with ``concurrency``, as ``kvc bench
--concurrency`` sends them: that many clients, each sending the next request
of the trace when its last one ends. The router
(:mod:`composer.simulate.routers`) places each request when it arrives,
seeing every engine's load (its requests in flight) and cache as they are
then. The engine looks the request up at once (its hits are what the caches
hold then, not the blocks of requests still running) and stores its blocks
when it ends. How long that takes is :mod:`composer.simulate.steps`: vLLM's
scheduler step by step (a token budget per step, chunked prefills beside
decodes, a queue, the KV cache's blocks), at :mod:`composer.simulate.cost`'s
costs; a busy engine's requests wait, and the router's load terms see it.

The result: requests, served fraction and queueing per engine, and TTFT and
end-to-end percentiles.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from composer.pipeline import ResolvedPipeline
from composer.simulate.cost import CALIBRATED, CostModel
from composer.simulate.replay import (
    Replay,
    _check_options,
    collector_paused,
    unit_for,
)
from composer.simulate.results import TenantResult, fallback_line
from composer.simulate.routers import ROUTERS, FleetView, check_router, make_router
from composer.simulate.steps import Job, StepEngine
from composer.simulate.tiers import SimKVGroup, SimulateError
from composer.trace import MOONCAKE_BLOCK_TOKENS, KeyMaker, TraceRequest

__all__ = ["ROUTERS", "EngineStats", "FleetResult", "simulate_fleet"]

#: A request's prompt tokens, its units' keys, and how many may be served.
Units = tuple[int, list[bytes], int]
PERCENTILES = (50, 90, 99)


@dataclass
class EngineStats(TenantResult):
    """One engine's requests, what was served of them, and how busy it was."""

    #: Time-averaged requests in flight over the run, and the most at once.
    mean_in_flight: float = 0.0
    max_in_flight: int = 0
    #: Mean seconds a request's TTFT exceeds its TTFT on an idle engine (queued, or in
    #: steps shared with others).
    mean_wait_s: float = 0.0
    #: Requests vLLM would have preempted (its KV cache full), as ``kvc bench`` counts them.
    preemptions: int = 0


@dataclass
class FleetResult:
    router: str
    engines: int
    requests: int
    prompt_tokens: int
    #: Requests each engine served, busiest first (as ``kvc bench --fleet`` reports them).
    engine_requests: list[int]
    #: Prompt tokens served, by vLLM's prefix cache (``<vllm>``) and by each node.
    tokens_served: dict[str, int] = field(default_factory=dict)
    #: Per engine, in engine order.
    per_engine: list[EngineStats] = field(default_factory=list)
    #: Seconds, by percentile.
    ttft_s: dict[int, float] = field(default_factory=dict)
    e2e_s: dict[int, float] = field(default_factory=dict)
    #: From the first arrival to the last end.
    makespan_s: float = 0.0
    #: How requests arrived ("4 in flight", "trace timestamps x1").
    arrivals: str = ""
    cost: CostModel = CALIBRATED
    #: Per tenant (the trace's ``tenant``), all engines together, when the trace names any.
    tenants: dict[str, TenantResult] = field(default_factory=dict)
    #: Each cache policy switched off because it raised, on any engine: the node's
    #: ``policy_fallbacks`` (:class:`~composer.simulate.replay.NodeResult`), with
    #: ``engine`` and ``node``.
    policy_fallbacks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def policy_failures(self) -> list[str]:
        """Each cache policy switched off, engine by engine (:func:`fallback_line`)."""
        return [
            f"engine {f.get('engine')}, " + fallback_line(str(f.get("node")), f)
            for f in self.policy_fallbacks
        ]

    @property
    def fraction_served(self) -> float:
        return sum(self.tokens_served.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    def fraction(self, node: str) -> float:
        return self.tokens_served.get(node, 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float | None:
        """The busiest engine's requests over the mean (1.0: even)."""
        if len(self.engine_requests) < 2 or not self.requests:
            return None
        return max(self.engine_requests) / (self.requests / len(self.engine_requests))

    def as_dict(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "engines": self.engines,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "requests_by_engine": self.engine_requests,
            "imbalance": self.imbalance,
            "tokens_served": self.tokens_served,
            "fraction_served": self.fraction_served,
            "arrivals": self.arrivals,
            "ttft_s": {f"p{p}": v for p, v in self.ttft_s.items()},
            "e2e_s": {f"p{p}": v for p, v in self.e2e_s.items()},
            "makespan_s": self.makespan_s,
            "per_engine": [e.as_dict() for e in self.per_engine],
            "cost": self.cost.as_dict(),
            "tenants": {name: t.as_dict() for name, t in self.tenants.items()},
            "policy_fallbacks": self.policy_fallbacks,
        }


class _Engine:
    """One engine: its steps (:class:`~composer.simulate.steps.StepEngine`), and how busy
    it was (requests in flight over time, the most at once, their waits)."""

    __slots__ = ("steps", "in_flight", "last", "area", "peak", "wait", "idle_since", "router_cpu")

    def __init__(self, cost: CostModel, block_size: int, groups: Sequence[SimKVGroup]) -> None:
        self.steps = StepEngine(cost, block_size, groups)
        self.in_flight = 0
        self.last = self.area = self.wait = 0.0
        self.peak = 0
        #: When its last step ended (idle since then unless a step is under way).
        self.idle_since = 0.0
        #: The router's CPU spent on the shared cores up to its last step's start.
        self.router_cpu = 0.0

    def count(self, now: float, change: int) -> None:
        self.area += self.in_flight * (now - self.last)
        self.last = now
        self.in_flight += change
        self.peak = max(self.peak, self.in_flight)


def simulate_fleet(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    *,
    engines: int,
    router: str,
    bytes_per_block: int,
    block_size: int = 32,
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vllm_cache_blocks: int = 0,
    groups: Sequence[SimKVGroup] | None = None,
    exact: bool = False,
    concurrency: int | None = None,
    speedup: float = 1.0,
    max_output_tokens: int | None = None,
    cost: CostModel = CALIBRATED,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    units: Sequence[Units] | None = None,
) -> FleetResult:
    """Replay ``trace`` through ``engines`` copies of ``pipeline`` behind ``router``.

    Blocks move in units as :func:`composer.simulate.simulate` moves them (a
    whole trace block where the block size divides it, unless ``exact``).
    ``max_output_tokens`` caps each request's output (as ``kvc bench
    --max-output-tokens``). ``seed``: the random policies' draws. ``units``: each
    request's :meth:`~composer.simulate.replay.Replay.units`, when already made
    (:func:`composer.simulate.sweep.simulate_many` makes them once for all its
    runs)."""
    _check_options(bytes_per_block, block_size, trace_block_tokens, vllm_cache_blocks)
    if engines < 1:
        raise SimulateError(f"--fleet must be >= 1, got {engines}")
    check_router(router)
    if concurrency is not None and concurrency < 1:
        raise SimulateError(f"--concurrency must be >= 1, got {concurrency}")
    if not speedup > 0 or math.isinf(speedup):
        raise SimulateError(f"--speedup must be a finite number > 0, got {speedup}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise SimulateError(f"--max-output-tokens must be >= 1, got {max_output_tokens}")
    kv_groups = tuple(groups or (SimKVGroup("attention", bytes_per_block),))
    unit = unit_for(pipeline, overrides or {}, kv_groups, block_size, trace_block_tokens, exact, [])
    keymaker = KeyMaker(block_size * unit, trace_block_tokens)
    replays = [
        Replay(
            pipeline, overrides or {}, keymaker, unit, bytes_per_block, vllm_cache_blocks, kv_groups
        )
        for _ in range(engines)
    ]
    if units is None:
        units = [replays[0].units(r) for r in trace]
    elif len(units) != len(trace):
        raise ValueError("units: one per request of the trace")
    run = _Run(replays, router, keymaker, cost, seed, max_output_tokens, block_size, kv_groups)
    with collector_paused():
        run.replay(trace, units, concurrency, speedup)
    return run.result(router, len(trace), concurrency, speedup)


class _Run:
    """The event loop: arrivals, requests reaching their engine's queue, each engine's
    steps, the router's view."""

    def __init__(
        self,
        replays: list[Replay],
        router: str,
        keymaker: KeyMaker,
        cost: CostModel,
        seed: int,
        max_output_tokens: int | None,
        block_size: int,
        groups: Sequence[SimKVGroup],
    ) -> None:
        self.replays, self.keymaker, self.cost = replays, keymaker, cost
        self.max_output = max_output_tokens
        self.view = FleetView(replays, [0] * len(replays), pending=[0] * len(replays))
        self.choose = make_router(router, len(replays), seed)
        self.engines = [_Engine(cost, block_size, groups) for _ in replays]
        #: Engines with requests (their steps slow down when they fill the cores they
        #: share: :meth:`~composer.simulate.cost.CostModel.shared_step`), and the
        #: router's CPU seconds spent on those cores so far (while the engines filled
        #: them; with a core free it runs there).
        self.busy = 0
        self.router_cpu = 0.0
        self.counts = [0] * len(replays)
        self.ttfts: list[float] = []
        self.e2es: list[float] = []
        self.first = self.end = 0.0
        #: (time, kind, order, engine or request index, the request on an engine): kind
        #: 0 an engine's step ends, 1 an arrival, 2 a request reaches its engine's
        #: queue; steps first at equal times (a request that ends frees its client
        #: and load before the next arrives).
        self.events: list[tuple[float, int, int, int, Job | None]] = []
        self.order = 0

    def _push(self, when: float, kind: int, what: int, job: Job | None = None) -> None:
        self.order += 1
        heapq.heappush(self.events, (when, kind, self.order, what, job))

    def replay(
        self,
        trace: Sequence[TraceRequest],
        units: Sequence[Units],
        concurrency: int | None,
        speedup: float,
    ) -> None:
        if concurrency is not None:
            sent = min(concurrency, len(trace))
            for i in range(sent):
                self._push(0.0, 1, i)
        else:
            start = min(r.timestamp_ms for r in trace)
            for i, r in enumerate(trace):
                self._push((r.timestamp_ms - start) / 1000.0 / speedup, 1, i)
            sent = len(trace)
        events = self.events
        touched: set[int] = set()
        while events:
            now, kind, _, what, job = heapq.heappop(events)
            if kind == 1:
                self._arrive(now, what, trace[what], units[what])
            elif kind == 2 and job is not None:
                self.engines[what].steps.add(job)
                touched.add(what)
            else:
                touched.add(what)
                ended = self._step_ended(now, what)
                if concurrency is not None:
                    for _ in range(ended):
                        if sent < len(trace):
                            self._push(now, 1, sent)
                            sent += 1
            if touched and (not events or events[0][0] > now):
                # Every event of this moment is in: the engines it touched step.
                for e in sorted(touched):
                    self._start_step(now, e)
                touched.clear()
        self.end = max((e.last for e in self.engines), default=0.0)

    def _arrive(self, now: float, index: int, req: TraceRequest, units: Units) -> None:
        """The router places the request; its engine looks it up at once (its hits are
        what the caches hold now); it reaches the engine's queue after its way in
        (``request_s``, slower while the engines fill the cores they share, where the
        router's CPU for it is taken from them)."""
        replays, view, cost = self.replays, self.view, self.cost
        prompt, keys, limit = units
        view.estimate = None
        e = self.choose(view, req, keys, limit, now)
        self.counts[e] += 1
        view.load[e] += 1
        way_in = cost.way_in(self.busy)
        if cost.fills(self.busy):
            self.router_cpu += cost.router_cpu_s
        self.busy += int(self.engines[e].in_flight == 0)
        self.engines[e].count(now, +1)
        started = replays[e].start(prompt, keys, limit, req, now)
        if keys and limit:
            view.holders.setdefault(keys[0], set()).add(e)
        output = self.keymaker.scale(req.output_length)
        if self.max_output is not None:
            output = min(output, self.max_output)
        loaded = started.tokens_served - started.vllm_tokens
        job = Job(index, now, prompt, started.tokens_served, loaded, output, started)
        job.reserved = job.reserved if view.estimate is None else view.estimate
        view.pending[e] += job.reserved
        self._push(now + way_in, 2, e, job)

    def _step_ended(self, now: float, e: int) -> int:
        """Engine ``e``'s step ended: first tokens, requests done; how many ended."""
        engine = self.engines[e]
        engine.idle_since = now
        first, done = engine.steps.end_step()
        for job in first:
            job.ttft = now - job.arrival
            self.ttfts.append(job.ttft)
            self.view.pending[e] -= job.reserved
            engine.wait += job.ttft - self.cost.alone_ttft_s(job.prompt - job.cached, job.loaded)
        for job in done:
            self.replays[e].finish(job.started)
            self.e2es.append(now - job.arrival)
            self.view.load[e] -= 1
            engine.count(now, -1)
            self.busy -= int(engine.in_flight == 0)
        return len(done)

    def _start_step(self, now: float, e: int) -> None:
        engine = self.engines[e]
        if not engine.steps.busy:
            took = engine.steps.start_step()
            if took is not None:
                cost = self.cost
                took = cost.shared_step(took, self.busy, self.router_cpu - engine.router_cpu)
                engine.router_cpu = self.router_cpu
                took += cost.woken(now - engine.idle_since)
                self._push(now + took, 0, e)

    def result(
        self, router: str, requests: int, concurrency: int | None, speedup: float
    ) -> FleetResult:
        served: dict[str, int] = {}
        per_engine: list[EngineStats] = []
        fallbacks: list[dict[str, Any]] = []
        span = self.end - self.first
        for e, (replay, engine, count) in enumerate(
            zip(self.replays, self.engines, self.counts, strict=True)
        ):
            for row in replay.rows(count):
                if row.lookup:
                    served[row.id] = served.get(row.id, 0) + row.tokens_served
                fallbacks += [{"engine": e, "node": row.id, **f} for f in row.policy_fallbacks]
            per_engine.append(
                EngineStats(
                    requests=count,
                    prompt_tokens=replay.prompt_total,
                    tokens_served=replay.served_total,
                    mean_in_flight=engine.area / span if span > 0 else 0.0,
                    max_in_flight=engine.peak,
                    mean_wait_s=engine.wait / count if count else 0.0,
                    preemptions=engine.steps.preemptions,
                )
            )
        tenants: dict[str, TenantResult] = {}
        for replay in self.replays:
            for name, t in replay.tenants.items():
                total = tenants.setdefault(name, TenantResult())
                total.requests += t.requests
                total.prompt_tokens += t.prompt_tokens
                total.tokens_served += t.tokens_served
        arrivals = (
            f"{concurrency} in flight"
            if concurrency is not None
            else f"trace timestamps{f' / {speedup:g}' if speedup != 1 else ''}"
        )
        return FleetResult(
            router,
            len(self.replays),
            requests,
            sum(r.prompt_total for r in self.replays),
            sorted(self.counts, reverse=True),
            served,
            per_engine,
            _percentiles(self.ttfts),
            _percentiles(self.e2es),
            span,
            arrivals,
            self.cost,
            tenants if any(tenants) else {},
            fallbacks,
        )


def _percentiles(values: list[float]) -> dict[int, float]:
    """Nearest-rank percentiles."""
    if not values:
        return {}
    ordered = sorted(values)
    n = len(ordered)
    return {p: ordered[min(n - 1, max(0, math.ceil(p / 100 * n) - 1))] for p in PERCENTILES}
