"""``kvc simulate --fleet``'s engine model (:mod:`composer.simulate.steps`) calibrated on
one real engine, and its predictions side by side with what the engine measured.

One ``kvc serve`` engine (the tiny model, one core, as each engine of
``kvc bench --fleet``: ``examples/fleet-cpu-events.yaml``, vLLM's own prefix
cache off, so that every cached prompt token a response reports was loaded
from the tier; its KV cache 80 blocks of 32 tokens) replays the slice of
``benchmarks/router_fleet.py`` (the Mooncake conversations that come back,
lengths scaled by 16, 16 output tokens) at 1, 2, 4, 6 and 8 requests in
flight, its caches emptied before each; then a plain engine (no connector)
at 1, 4 and 8. The costs are fitted on the tier's runs at 1, 4 and 8
(:func:`composer.simulate.calibrate.fit`, what ``kvc calibrate`` does with
``kvc bench``'s ``bench.json``); every run is then predicted: the tier's by
``kvc simulate --fleet 1 --concurrency N`` on the trace (its own model of the
tier's hits), the plain engine's from the measured prompts. Printed: the
fitted costs and, per run, TTFT p50 and p90, requests per second and the
served fraction, measured (predicted). Writes ``kvc-bench-cost/bench.json``
(the tier's runs) and ``kvc-bench-cost/calibration.json``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from composer import load_pipeline
from composer.bench.fleet import empty, fleet
from composer.bench.replay import Prompt, make_prompts, vocab_size_of
from composer.bench.report import RunResult, write_report
from composer.bench.run import measure
from composer.bench.servers import Config, ServerSpec
from composer.simulate.calibrate import Served, fit, samples_of, serve, write_calibration
from composer.simulate.cost import CALIBRATED, CostModel
from composer.simulate.fleet import simulate_fleet
from composer.simulate.shape import model_shape
from composer.testing.tiny_model import GEMMA3_SHAPE, build_tiny_model
from composer.trace import TraceRequest, multi_turn, read_trace

ROOT = Path(__file__).parent.parent
TRACE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
#: The conversations that come back among the trace's first this many requests.
REQUESTS = int(os.environ.get("KVC_BENCH_COST_REQUESTS", "500"))
SCALE, BLOCK, MAX_LEN, OUTPUT, VLLM_BLOCKS = 16, 32, 2048, 16, 80
TIER_RUNS, FITTED, PLAIN_RUNS = (1, 2, 4, 6, 8), (1, 4, 8), (1, 4, 8)
#: The hybrid's KV cache: its KV cache groups share vLLM's blocks (a sliding window's
#: takes blocks for a whole chunk, then keeps its window's); 80 would not hold a whole
#: 2048-token request.
HYBRID_BLOCKS = 2 * VLLM_BLOCKS
WORKDIR = Path("kvc-bench-cost")
#: vLLM's limits on the measured engine (its CPU build's defaults; the cache given).
LIMITS = replace(CALIBRATED, num_gpu_blocks=VLLM_BLOCKS)


def runs_on(
    config: Config, server: ServerSpec, prompts: list[Prompt], concurrencies: tuple[int, ...]
) -> dict[int, RunResult]:
    results: dict[int, RunResult] = {}
    with fleet(config, server, 1, WORKDIR) as (engine,):
        for n in concurrencies:
            empty(engine.url)
            results[n] = measure(
                f"{config.name}, {n} in flight",
                engine.url,
                prompts,
                concurrency=n,
                speedup=1.0,
                progress=False,
            )
    return results


def predicted_on_trace(
    model: str, trace: list[TraceRequest], cost: CostModel, concurrency: int
) -> tuple[float, float, float, float]:
    """What ``kvc simulate --fleet 1 --concurrency N`` predicts: TTFT p50 and p90,
    requests per second, the share of prompt tokens the tier served."""
    pipeline = load_pipeline(PIPELINE)
    shape = model_shape(model, BLOCK, pipeline)
    result = simulate_fleet(
        pipeline,
        trace,
        engines=1,
        router="round_robin",
        bytes_per_block=shape.bytes_per_block,
        block_size=BLOCK,
        trace_block_tokens=512 // SCALE,
        groups=shape.groups,
        concurrency=concurrency,
        max_output_tokens=OUTPUT,
        cost=cost,
    )
    rate = result.requests / result.makespan_s if result.makespan_s else 0.0
    return result.ttft_s[50], result.ttft_s[90], rate, result.fraction_served


def predicted_from(served: Served) -> tuple[float, float, float, float]:
    return served.ttft(50), served.ttft(90), served.requests_per_s, 0.0


def row(
    name: str, n: int, real: RunResult, predicted: tuple[float, float, float, float], fitted: bool
) -> str:
    summary = real.summary()
    measured = (
        summary["ttft_s"]["p50"],
        summary["ttft_s"]["p90"],
        summary["requests_per_s"],
        summary["served"]["connector"],
    )
    scale = (1000, 1000, 1, 100)
    cells = []
    for i, (m, p) in enumerate(zip(measured, predicted, strict=True)):
        gap = f" {100 * (p - m) / m:+.0f} %" if m and i < 3 else ""
        cells.append(f"{scale[i] * m:.1f} ({scale[i] * p:.1f}){gap}")
    return f"| {name} | {n} | {' | '.join(cells)} | {'yes' if fitted else 'no'} |"


def measured_runs(
    model: str,
    trace: list[TraceRequest],
    config: Config,
    concurrencies: tuple[int, ...],
    blocks: int = VLLM_BLOCKS,
) -> tuple[dict[int, RunResult], list[TraceRequest]]:
    """The slice through one engine of ``model`` at each concurrency; the requests kept
    (those that fit ``MAX_LEN``)."""
    prompts, skipped = make_prompts(
        trace,
        scale=SCALE,
        vocab_size=vocab_size_of(model) or 0,
        max_output_tokens=OUTPUT,
        max_model_len=MAX_LEN,
    )
    server = ServerSpec(
        model=model,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        num_blocks=blocks,
        extra_args=["--enforce-eager"],
    )
    kept = [r for i, r in enumerate(trace) if i not in set(skipped)]
    return runs_on(config, server, prompts, concurrencies), kept


def fitted(
    runs: dict[int, RunResult], blocks: int = VLLM_BLOCKS, model: str | None = None
) -> CostModel:
    """The costs fitted on ``runs`` at :data:`FITTED` (``model``: its KV cache groups
    share the ``blocks``; none: one full-attention group)."""
    samples = {n: samples_of([vars(r) for r in runs[n].records]) for n in FITTED}
    limits = replace(LIMITS, num_gpu_blocks=blocks)
    groups = model_shape(model, BLOCK).groups if model else ()
    return fit(samples, {n: runs[n].wall_s for n in FITTED}, limits, BLOCK, groups)


def main() -> int:
    trace = multi_turn(read_trace(TRACE, limit=REQUESTS))
    tiny, hybrid = str(build_tiny_model()), str(build_tiny_model(GEMMA3_SHAPE))
    WORKDIR.mkdir(exist_ok=True)
    tier_config = Config(PIPELINE.stem, PIPELINE, prefix_caching=False)
    tier, kept = measured_runs(tiny, trace, tier_config, TIER_RUNS)
    plain, _ = measured_runs(tiny, trace, Config.parse("none"), PLAIN_RUNS)
    hybrid_tier, hybrid_kept = measured_runs(hybrid, trace, tier_config, FITTED, HYBRID_BLOCKS)
    for name, runs in (("tier", tier), ("plain", plain), ("hybrid", hybrid_tier)):
        # (kvc calibrate WORKDIR/NAME/bench.json fits them again, as a user would.)
        write_report(list(runs.values()), WORKDIR / name, plot=False)
    cost, plain_cost = fitted(tier), fitted(plain)
    hybrid_cost = fitted(hybrid_tier, HYBRID_BLOCKS, hybrid)
    print(f"slice: {len(kept)} requests, {OUTPUT} output tokens each, one engine, one core")
    print(f"fitted on the tier's runs at {', '.join(map(str, FITTED))} in flight: {cost}")
    print(f"the plain engine's (no connector), likewise: {plain_cost}")
    print(f"the hybrid model's (Gemma-3-shaped, 64-token window), likewise: {hybrid_cost}\n")
    print(
        "| engine | in flight | TTFT p50 ms measured (predicted) | TTFT p90 ms measured "
        "(predicted) | requests/s measured (predicted) | served % measured (predicted) "
        "| fitted on it |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    checked = {}
    for n, result in tier.items():
        predicted = predicted_on_trace(tiny, kept, cost, n)
        print(row("tier", n, result, predicted, n in FITTED))
        checked[f"tier, {n} in flight"] = {
            "measured": result.summary()["ttft_s"],
            "predicted ttft p50, p90": predicted[:2],
        }
    for n, result in plain.items():
        samples_n = samples_of([vars(r) for r in result.records])
        predicted = predicted_from(serve(samples_n, n, plain_cost, BLOCK))
        print(row("plain", n, result, predicted, n in FITTED))
    for n, result in hybrid_tier.items():
        predicted = predicted_on_trace(hybrid, hybrid_kept, hybrid_cost, n)
        print(row("hybrid, tier", n, result, predicted, True))
    write_calibration(WORKDIR / "calibration.json", cost, checked)
    every = [*tier.values(), *plain.values(), *hybrid_tier.values()]
    return int(any(r.errors for r in every))


if __name__ == "__main__":
    raise SystemExit(main())
