"""A fleet behind vLLM's router (``kvc bench --fleet``'s code), each policy side by side,
and ``kvc simulate --fleet``'s prediction of each.

Two ``kvc serve`` engines (the tiny model, one core each for all of an engine's
processes, vLLM's own KV cache
``KVC_BENCH_VLLM_BLOCKS`` blocks, too small for the slice) run
``examples/fleet-cpu-events.yaml`` (an offload-cpu tier publishing its KV
events) behind vllm-router. The slice: the conversations of the first
``KVC_BENCH_FLEET_REQUESTS`` requests of the Mooncake conversation trace that
come back (:func:`composer.trace.multi_turn`), the requests that fit
``--max-model-len``, lengths scaled by 16. Every policy replays the same
requests on emptied engines, in alternating order over ``KVC_BENCH_ROUNDS``
rounds (four by default: with four in flight a ``kv_aware`` policy's served
fraction moves by up to 6 points from one round to the next, with the order in
which the clients' requests reach the router, and the comparison is of the
mean); each request names its conversation in ``x-session-id``.

Run once with one request at a time and once with ``KVC_BENCH_CONCURRENCY``
in flight (the router's load balancing at work); after each, ``kvc simulate
--fleet``'s prediction at the same concurrency beside what was measured: the
served fraction (percentage points apart), the requests per engine, TTFT p50
and p90 and the requests per second. The engine model's costs are fitted in the
same run (:func:`calibrated`: one such engine alone behind the router, at 1, 4
and 8 in flight, as ``kvc calibrate`` fits them), not taken from another day:
this machine's speed moves by 20 % from one session to the next (the same
single-engine runs measured 7.5-8.1 ms TTFT p50 one day, 9.7 another), and
within a run, so the calibration's runs take their turns in the policies'
rounds (:func:`measure`). The
fleet adds two costs to one engine alone, both fitted on ``round_robin``
(:func:`shared_cores`): an idle engine's wake-up (at 1 in flight its requests
alternate between the engines) and, as the engines share this machine's cores
with vllm-router and the clients, the factor on a step's time while they fill
them (``KVC_BENCH_CONCURRENCY`` in flight); every other run is their check.
The router's own CPU a request is an input, as measured around each policy's
replay (``kvc bench``'s ``router_cpu_ms_per_request``): on the shared cores it
is taken from the engines (``kv_aware`` reads every engine's KV events). Every
engine is warmed up first (:data:`WARM_UP` passes of the slice at each number in
flight it is measured at, not measured): an engine's first pass at a number in
flight runs slower, and would make the first run's costs (the calibration's,
the first policy's) too high.
Writes ``kvc-bench-fleet/``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from benchmarks.cost_model import FITTED, fitted
from composer import load_pipeline
from composer.bench import report as bench_report
from composer.bench import spec as bench_spec
from composer.bench.fleet import POLICIES, fleet, policy, run_policy, warm_up
from composer.bench.replay import make_prompts, vocab_size_of
from composer.bench.report import RunResult, pool
from composer.bench.servers import Config, ServerSpec
from composer.simulate.calibrate import FleetRun, fit_fleet
from composer.simulate.cost import CostModel
from composer.simulate.fleet import FleetResult, simulate_fleet
from composer.simulate.shape import model_shape
from composer.testing.tiny_model import build_tiny_model
from composer.trace import TraceRequest, multi_turn, read_trace, write_trace

HERE = Path(__file__).parent
ROOT = HERE.parent
SHARED = ROOT.parent / "shared/traces/mooncake-conversation_trace.jsonl"
TRACE = os.environ.get(
    "KVC_BENCH_TRACE",
    str(
        SHARED
        if SHARED.exists()
        else ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
    ),
)
REQUESTS = int(os.environ.get("KVC_BENCH_FLEET_REQUESTS", "1200"))
ENGINES = int(os.environ.get("KVC_BENCH_FLEET_ENGINES", "2"))
CONCURRENCY = int(os.environ.get("KVC_BENCH_CONCURRENCY", "4"))
ROUNDS = int(os.environ.get("KVC_BENCH_ROUNDS", "4"))
VLLM_BLOCKS = int(os.environ.get("KVC_BENCH_VLLM_BLOCKS", "80"))
#: Passes of the slice through every engine before it is measured (kvc bench --warm-up),
#: at each number in flight it is measured at: an engine's first pass at a number in
#: flight it has not run at is slower (at one in flight, after a pass at four: 18.3-19.4
#: ms TTFT p90 against 14.2-15.2 in the next three).
WARM_UP = int(os.environ.get("KVC_BENCH_WARM_UP", "1"))
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
#: Every policy kvc bench --fleet measures, and kv_aware-tiers with vllm-router's own
#: settings that kvc simulate found to serve the tiered fleet best (docs/fleet.md):
#: a tier's block credited in full, and a session bound to its engine for 10 minutes.
MEASURED = (*POLICIES, "kv_aware-tiers:external=1", "kv_aware-tiers:affinity=600")
SCALE, BLOCK, MAX_LEN, OUTPUT = 16, 32, 2048, 4
#: The calibration's runs: requests in flight (those cost_model.py fits on).
CALIBRATION_RUNS = FITTED
WORKDIR = Path("kvc-bench-fleet")


def fleet_slice(model: str, path: Path) -> Path:
    """The slice's requests that fit, written as a trace both the bench and the
    simulator read."""
    trace = multi_turn(read_trace(TRACE, limit=REQUESTS))
    vocab = vocab_size_of(model) or 0
    _, skipped = make_prompts(
        trace, scale=SCALE, vocab_size=vocab, max_output_tokens=OUTPUT, max_model_len=MAX_LEN
    )
    left_out = set(skipped)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, [r for i, r in enumerate(trace) if i not in left_out])
    return path


def bench(model: str, trace: list[TraceRequest]) -> bench_spec.BenchSpec:
    """What every run replays, and against what engines (each run sets its own number
    in flight; :func:`measure` runs the rounds and the policies)."""
    return bench_spec.BenchSpec(
        trace=trace,
        configs=[Config.parse(str(PIPELINE))],
        server=ServerSpec(
            model=model,
            block_size=BLOCK,
            max_model_len=MAX_LEN,
            num_blocks=VLLM_BLOCKS,
            extra_args=["--enforce-eager"],
        ),
        scale=SCALE,
        concurrency=1,
        max_output_tokens=OUTPUT,
        workdir=WORKDIR,
        progress=False,
        warm_up=WARM_UP,
    )


def measure(
    model: str, trace: list[TraceRequest]
) -> tuple[dict[int, RunResult], dict[int, list[RunResult]]]:
    """The calibration's runs (by requests in flight) and the fleet's (by requests in
    flight, one per policy), in :data:`ROUNDS` rounds of alternating order, pooled.

    The calibration is one engine alone behind the router (round_robin over it) at 1,
    4 and 8 in flight, vLLM's prefix cache off (so that every cached token is one the
    tier loaded: ``kvc calibrate``'s rule); the fleet runs each policy at 1 and
    :data:`CONCURRENCY` in flight. Both are up from the start (an idle engine takes no
    CPU), are warmed up at each number in flight they run at, and take their turns in
    the same rounds, so that what drifts within a run drifts for both. (Calibrated
    first, and warmed up at four in flight only, the one engine measured 20 % slower at
    one in flight than the fleet's engine doing the same work later.)"""
    spec = bench(model, trace)
    assert spec.server is not None
    prompts, skipped = bench_spec.bench_prompts(spec)
    alone = Config(PIPELINE.stem, PIPELINE, prefix_caching=False)
    runs = [(0, n, POLICIES["round_robin"]) for n in CALIBRATION_RUNS] + [
        (ENGINES, n, policy(name)) for n in (1, CONCURRENCY) for name in MEASURED
    ]
    pooled: dict[tuple[int, int, str], RunResult] = {}
    for where in ("calibration", "fleet"):
        (WORKDIR / where).mkdir(parents=True, exist_ok=True)
    with (
        fleet(alone, spec.server, 1, WORKDIR / "calibration") as one,
        fleet(spec.configs[0], spec.server, ENGINES, WORKDIR / "fleet") as engines,
    ):
        for size, n in dict.fromkeys((size, n) for size, n, _ in runs):  # (each once)
            workdir = WORKDIR / ("calibration" if size == 0 else "fleet") / f"warm-up-{n}"
            workdir.mkdir(exist_ok=True)
            group = one if size == 0 else engines
            warm_up(replace(spec, concurrency=n, workdir=workdir), group, prompts)
        for round_index in range(ROUNDS):
            for size, n, p in runs if round_index % 2 == 0 else runs[::-1]:
                where = "calibration" if size == 0 else "fleet"
                log = WORKDIR / where / f"router-{p.name}-{n}-{round_index + 1}.log"
                result = run_policy(
                    replace(spec, concurrency=n), one if size == 0 else engines, p, prompts, log
                )
                result.skipped = skipped
                key = (size, n, p.name)
                pooled[key] = pool(pooled[key], result) if key in pooled else result
    calibration = {n: pooled[0, n, "round_robin"] for n in CALIBRATION_RUNS}
    fleet_runs = {n: [pooled[ENGINES, n, name] for name in MEASURED] for n in (1, CONCURRENCY)}
    return calibration, fleet_runs


def calibrated(runs: dict[int, RunResult]) -> CostModel:
    """The engine model's costs, fitted on the calibration's runs (as ``kvc calibrate``
    fits them)."""
    cost = fitted(runs, VLLM_BLOCKS)
    print(f"fitted in this run on one engine behind the router, {CALIBRATION_RUNS} in flight:")
    print(f"  {cost}")
    for n, run in runs.items():
        summary = run.summary()
        print(
            f"  one engine, {n} in flight: TTFT p50 {1000 * summary['ttft_s']['p50']:.1f} ms, "
            f"p90 {1000 * summary['ttft_s']['p90']:.1f} ms, "
            f"{summary['requests_per_s']:.1f} requests/s"
        )
    return cost


def main() -> int:
    model = str(build_tiny_model())
    trace_path = fleet_slice(model, WORKDIR / "slice.jsonl")
    trace = read_trace(trace_path)
    print(f"slice: {len(trace)} requests ({trace_path}); {ENGINES} engines; {ROUNDS} rounds")
    calibration, measured = measure(model, trace)
    cost = calibrated(calibration)
    for concurrency, results in measured.items():
        bench_report.write_report(results, WORKDIR / f"concurrency-{concurrency}", plot=False)
        print(f"\n### {concurrency} request(s) in flight\n")
        print(bench_report.markdown_table(results))
    cost = shared_cores(model, trace, cost, measured)
    for concurrency, results in measured.items():
        print(f"\nmeasured vs kvc simulate --fleet --concurrency {concurrency}:")
        for result in results:
            with_router = replace(cost, router_cpu_s=router_cpu_s(result))
            predicted = predict(model, trace, concurrency, with_router, (result.config,))
            compare(result, predicted[result.config])
    return int(any(r.errors for results in measured.values() for r in results))


def shared_cores(
    model: str, trace: list[TraceRequest], cost: CostModel, measured: dict[int, list[RunResult]]
) -> CostModel:
    """``cost`` with what the fleet adds to one engine alone, fitted on ``round_robin``
    (:func:`composer.simulate.calibrate.fit_fleet`, as ``kvc simulate --fit-fleet`` fits
    it; the other policies' runs are the check): the time an idle engine takes to wake
    (at 1 in flight), then the cores the engines share with the router and the clients
    (this machine's, at most one per engine) and the factor on their steps while they
    fill them (at :data:`CONCURRENCY` in flight), besides the router's CPU (as
    measured)."""
    cores = min(os.cpu_count() or 1, ENGINES)

    def rate(concurrency: int, candidate: CostModel) -> float:
        run = predict(model, trace, concurrency, candidate, ("round_robin",))["round_robin"]
        return run.requests / run.makespan_s if run.makespan_s else 0.0

    runs = {
        n: FleetRun(float(r.summary()["requests_per_s"]), router_cpu_s(r))
        for n, results in measured.items()
        for r in results
        if r.config == "round_robin"
    }
    cost = fit_fleet(cost, runs, rate, cores)
    print(
        f"\nfitted on round_robin: an idle engine wakes in {1000 * cost.wake_s:.1f} ms (1 in "
        f"flight); {ENGINES} engines, the router and the clients on {cores} core(s): a step "
        f"takes {cost.shared_step_factor:.2f}x while the engines fill them "
        f"({CONCURRENCY} in flight), besides the router's {1000 * cost.router_cpu_s:.2f} ms "
        "of CPU a request"
    )
    return cost


def router_cpu_s(result: RunResult) -> float:
    """The router's CPU seconds a request, as measured in ``result`` (0 unread)."""
    cpu = result.summary()["router_cpu_ms_per_request"]
    return 0.0 if cpu is None else cpu / 1000


def predict(
    model: str,
    trace: list[TraceRequest],
    concurrency: int,
    cost: CostModel,
    policies: tuple[str, ...] = MEASURED,
) -> dict[str, FleetResult]:
    """kvc simulate --fleet's prediction of each policy at ``concurrency``."""
    pipeline = load_pipeline(PIPELINE)
    shape = model_shape(model, BLOCK, pipeline)
    return {
        policy: simulate_fleet(
            pipeline,
            trace,
            engines=ENGINES,
            router=policy,
            bytes_per_block=shape.bytes_per_block,
            block_size=BLOCK,
            trace_block_tokens=512 // SCALE,
            vllm_cache_blocks=VLLM_BLOCKS,
            groups=shape.groups,
            concurrency=concurrency,
            max_output_tokens=OUTPUT,
            cost=cost,
        )
        for policy in policies
    }


def compare(result: RunResult, sim: FleetResult) -> None:
    """Served fraction (percentage points apart), requests per engine (the largest gap,
    in points of the slice's requests), TTFT p50 and p90 and requests per second,
    measured against predicted; the router's CPU a request, measured."""
    measured = result.fraction(result.prefix_cache_tokens + result.connector_tokens)
    error = 100 * (measured - sim.fraction_served)
    total = sum(result.engine_requests) or 1
    by_engine = "/".join(f"{n:.0f}" for n in result.engine_requests)
    sim_by_engine = [n * ROUNDS for n in sim.engine_requests]
    gap = max(abs(m - p) for m, p in zip(result.engine_requests, sim_by_engine, strict=True))
    print(
        f"  {result.config}: served {100 * measured:.1f}% (predicted "
        f"{100 * sim.fraction_served:.1f}%, {error:+.1f} pp); requests by engine {by_engine} "
        f"(predicted {'/'.join(map(str, sim_by_engine))}, {100 * gap / total:.1f} pts apart)"
    )
    summary = result.summary()
    rate = sim.requests / sim.makespan_s if sim.makespan_s else 0.0
    timing = [
        (f"TTFT p{q}", 1000 * summary["ttft_s"][f"p{q}"], 1000 * sim.ttft_s[q], "ms")
        for q in (50, 90)
    ]
    timing.append(("requests/s", summary["requests_per_s"], rate, ""))
    print(
        "    "
        + "; ".join(
            f"{name} {m:.1f}{unit} (predicted {p:.1f}{unit}, {100 * (p - m) / m:+.0f} %)"
            for name, m, p, unit in timing
            if m
        )
    )
    if summary["router_cpu_ms_per_request"] is not None:
        # (On the cores the engines use: kv_aware's reading of every KV event shows here.)
        print(f"    vllm-router: {summary['router_cpu_ms_per_request']:.2f} ms of CPU a request")


if __name__ == "__main__":
    raise SystemExit(main())
