"""``kvc simulate --fleet N --router POLICY``: a trace through N engines behind a router, in time.

Each engine is a replay of its own (:class:`composer.simulate.replay._Replay`:
its vLLM prefix cache and its nodes' models). Requests arrive at the trace's
timestamps (divided by ``speedup``), or, with ``concurrency``, as ``kvc bench
--concurrency`` sends them: that many clients, each sending the next request
of the trace when its last one ends. The router
(:mod:`composer.simulate.routers`) places each request when it arrives,
seeing every engine's load (its requests in flight) and cache as they are
then. The engine looks the request up at once (vLLM schedules it in the next
step: its hits are what the caches hold then, not the blocks of requests
still running) and stores its blocks when it ends. How long that takes is
:mod:`composer.simulate.cost`'s model: the engine's requests in flight share
its speed, so a busy engine's requests wait, and the router's load terms see
it.

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
    Started,
    _check_options,
    _Replay,
    collector_paused,
    unit_for,
)
from composer.simulate.results import TenantResult, fallback_line
from composer.simulate.routers import ROUTERS, FleetView, check_router, make_router
from composer.simulate.tiers import SimKVGroup, SimulateError
from composer.trace import MOONCAKE_BLOCK_TOKENS, KeyMaker, TraceRequest

__all__ = ["ROUTERS", "EngineStats", "FleetResult", "simulate_fleet"]

#: A request's prompt tokens, its units' keys, and how many may be served.
Units = tuple[int, list[bytes], int]
#: Work left below this many seconds is done (float sums of shares).
_EPS = 1e-12
PERCENTILES = (50, 90, 99)


@dataclass
class EngineStats(TenantResult):
    """One engine's requests, what was served of them, and how busy it was."""

    #: Time-averaged requests in flight over the run, and the most at once.
    mean_in_flight: float = 0.0
    max_in_flight: int = 0
    #: Mean seconds a request's TTFT exceeds its prefill alone (time it shared the engine).
    mean_wait_s: float = 0.0


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
            "tenants": {
                name: t.as_dict() for name, t in self.tenants.items()
            },
            "policy_fallbacks": self.policy_fallbacks,
        }


class _Job:
    __slots__ = (
        "index", "engine", "arrival", "prefill", "decode", "alone", "started", "ttft", "computed",
        "reserved",
    )

    def __init__(
        self, index: int, engine: int, arrival: float, prefill: float, decode: float,
        started: Started,
    ) -> None:
        self.index, self.engine, self.arrival = index, engine, arrival
        self.prefill, self.decode, self.alone = prefill, decode, prefill
        self.started = started
        self.ttft = -1.0
        self.computed = started.prompt - started.tokens_served
        #: The prefill the router reserved for it (:attr:`FleetView.estimate`).
        self.reserved = self.computed


class _Engine:
    """One engine's requests in flight, sharing its speed (processor sharing)."""

    __slots__ = ("jobs", "last", "version", "area", "peak", "wait")

    def __init__(self) -> None:
        self.jobs: list[_Job] = []
        self.last = 0.0
        self.version = 0
        self.area = 0.0  # integral of requests in flight over time
        self.peak = 0
        self.wait = 0.0

    def advance(self, now: float, cost: CostModel) -> None:
        jobs = self.jobs
        dt = now - self.last
        if jobs and dt > 0:
            n = len(jobs)
            self.area += n * dt
            share = dt * cost.batch_speedup(n) / n
            for job in jobs:
                if job.prefill > _EPS:
                    job.prefill -= share
                else:
                    job.decode -= share
        self.last = now

    def next_step(self, now: float, cost: CostModel) -> float:
        """When the next request in flight ends its prefill or its decode."""
        n = len(self.jobs)
        rate = cost.batch_speedup(n) / n
        left = min(j.prefill if j.prefill > _EPS else j.decode for j in self.jobs)
        return now + max(0.0, left) / rate


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
    request's :meth:`~composer.simulate.replay._Replay.units`, when already made
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
    unit = unit_for(
        pipeline, overrides or {}, kv_groups, block_size, trace_block_tokens, exact, []
    )
    keymaker = KeyMaker(block_size * unit, trace_block_tokens)
    replays = [
        _Replay(pipeline, overrides or {}, keymaker, unit, bytes_per_block, vllm_cache_blocks,
                kv_groups)
        for _ in range(engines)
    ]
    if units is None:
        units = [replays[0].units(r) for r in trace]
    elif len(units) != len(trace):
        raise ValueError("units: one per request of the trace")
    run = _Run(replays, router, keymaker, cost, seed, max_output_tokens)
    with collector_paused():
        run.replay(trace, units, concurrency, speedup)
    return run.result(router, len(trace), concurrency, speedup)


class _Run:
    """The event loop: arrivals, each engine's next step, the router's view."""

    def __init__(
        self, replays: list[_Replay], router: str, keymaker: KeyMaker, cost: CostModel,
        seed: int, max_output_tokens: int | None,
    ) -> None:
        self.replays, self.keymaker, self.cost = replays, keymaker, cost
        self.max_output = max_output_tokens
        self.view = FleetView(replays, [0] * len(replays), pending=[0] * len(replays))
        self.choose = make_router(router, len(replays), seed)
        self.engines = [_Engine() for _ in replays]
        self.counts = [0] * len(replays)
        self.ttfts: list[float] = []
        self.e2es: list[float] = []
        self.first = self.end = 0.0
        #: (time, kind, order, what, version): kind 0 an engine's step, 1 an arrival;
        #: steps first at equal times (a request that ends frees its client and load
        #: before the next arrives).
        self.events: list[tuple[float, int, int, int, int]] = []
        self.order = 0

    def _push(self, when: float, kind: int, what: int, version: int = 0) -> None:
        self.order += 1
        heapq.heappush(self.events, (when, kind, self.order, what, version))

    def replay(
        self, trace: Sequence[TraceRequest], units: Sequence[Units], concurrency: int | None,
        speedup: float,
    ) -> None:
        if concurrency is not None:
            sent = min(concurrency, len(trace))
            for i in range(sent):
                self._push(0.0, 1, i)
        else:
            start = min(r.timestamp_ms for r in trace)
            self.first = 0.0
            for i, r in enumerate(trace):
                self._push((r.timestamp_ms - start) / 1000.0 / speedup, 1, i)
            sent = len(trace)
        events, engines, cost = self.events, self.engines, self.cost
        while events:
            now, kind, _, what, version = heapq.heappop(events)
            if kind == 1:
                self._arrive(now, what, trace[what], units[what])
                continue
            engine = engines[what]
            if version != engine.version:
                continue  # superseded: the engine's requests changed since
            engine.advance(now, cost)
            ended = self._step(now, what)
            if concurrency is not None:
                for _ in range(ended):
                    if sent < len(trace):
                        self._push(now, 1, sent)
                        sent += 1
        self.end = max((e.last for e in engines), default=0.0)

    def _arrive(self, now: float, index: int, req: TraceRequest, units: Units) -> None:
        replays, view = self.replays, self.view
        prompt, keys, limit = units
        view.estimate = None
        e = self.choose(view, req, keys, limit, now)
        self.counts[e] += 1
        view.load[e] += 1
        engine = self.engines[e]
        engine.advance(now, self.cost)
        started = replays[e].start(prompt, keys, limit, req, now)
        if keys and limit:
            view.holders.setdefault(keys[0], set()).add(e)
        loaded = started.tokens_served - started.vllm_tokens
        output = self.keymaker.scale(req.output_length)
        if self.max_output is not None:
            output = min(output, self.max_output)
        job = _Job(
            index, e, now,
            self.cost.prefill_s(prompt - started.tokens_served, loaded),
            self.cost.decode_s(max(1, output)),
            started,
        )
        engine.jobs.append(job)
        job.reserved = job.computed if view.estimate is None else view.estimate
        view.pending[e] += job.reserved
        engine.peak = max(engine.peak, len(engine.jobs))
        self._reschedule(now, e)

    def _step(self, now: float, e: int) -> int:
        """Requests of engine ``e`` whose prefill or decode ended now; how many ended."""
        engine = self.engines[e]
        ended = 0
        still: list[_Job] = []
        for job in engine.jobs:
            if job.prefill <= _EPS and job.ttft < 0:
                job.ttft = now - job.arrival
                self.ttfts.append(job.ttft)
                self.view.pending[e] -= job.reserved  # its first token: prefill done
                engine.wait += job.ttft - job.alone
            if job.prefill <= _EPS and job.decode <= _EPS:
                self.replays[e].finish(job.started)
                self.e2es.append(now - job.arrival)
                self.view.load[e] -= 1
                ended += 1
            else:
                still.append(job)
        engine.jobs = still
        self._reschedule(now, e)
        return ended

    def _reschedule(self, now: float, e: int) -> None:
        engine = self.engines[e]
        engine.version += 1
        if engine.jobs:
            self._push(engine.next_step(now, self.cost), 0, e, engine.version)

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
            f"{concurrency} in flight" if concurrency is not None
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
