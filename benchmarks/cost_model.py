"""The cost model of ``kvc simulate --fleet`` (:mod:`composer.simulate.cost`), calibrated on
one real engine at 1, 4 and 8 requests in flight, and the tier's hits against vLLM's.

One ``kvc serve`` engine (the tiny model, one core, as each engine of
``kvc bench --fleet``: ``examples/fleet-cpu-events.yaml``, its KV event
publisher on; vLLM's own prefix cache off, so that every cached prompt token a
response reports was loaded from the tier) replays the slice of
``benchmarks/router_fleet.py`` (the Mooncake conversations that come back,
lengths scaled by 16) at each concurrency, its caches emptied before each. One
request at a time gives the fixed, per-computed-token and per-loaded-token
seconds of a TTFT (least squares) and the seconds per output token; 4 and 8 in
flight give the engine's batching gain. Printed: the coefficients (per figure:
as they stand at that concurrency), the tier's hits over vLLM's count of them
at each concurrency, and the simulator's TTFT against the measured one with
the fitted model. Writes ``kvc-bench-cost/calibration.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from composer import load_pipeline
from composer.bench.fleet import empty, fleet
from composer.bench.replay import make_prompts, vocab_size_of
from composer.bench.report import RunResult
from composer.bench.run import measure
from composer.bench.servers import Config, ServerSpec
from composer.simulate.cost import CostModel, Sample, fit
from composer.simulate.fleet import simulate_fleet
from composer.simulate.shape import model_shape
from composer.testing.tiny_model import build_tiny_model
from composer.trace import TraceRequest, multi_turn, read_trace

ROOT = Path(__file__).parent.parent
TRACE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
#: The conversations that come back among the trace's first this many requests.
REQUESTS = int(os.environ.get("KVC_BENCH_COST_REQUESTS", "500"))
SCALE, BLOCK, MAX_LEN, OUTPUT, VLLM_BLOCKS = 16, 32, 2048, 16, 80
CONCURRENCY = (1, 4, 8)
WORKDIR = Path("kvc-bench-cost")


def samples(result: RunResult) -> list[Sample]:
    return [
        Sample(
            r.prompt_tokens - (r.cached_tokens or 0), r.cached_tokens or 0, r.output_tokens,
            r.ttft_s, r.e2e_s,
        )
        for r in result.ok
        if r.ttft_s is not None and r.e2e_s is not None
    ]


def predicted_ttft(
    model: str, trace: list[TraceRequest], cost: CostModel, concurrency: int
) -> dict[int, float]:
    pipeline = load_pipeline(PIPELINE)
    shape = model_shape(model, BLOCK, pipeline)
    return simulate_fleet(
        pipeline, trace, engines=1, router="round_robin", bytes_per_block=shape.bytes_per_block,
        block_size=BLOCK, trace_block_tokens=512 // SCALE, groups=shape.groups,
        concurrency=concurrency, max_output_tokens=OUTPUT, cost=cost,
    ).ttft_s


def main() -> int:
    model = str(build_tiny_model())
    vocab = vocab_size_of(model) or 0
    trace = multi_turn(read_trace(TRACE, limit=REQUESTS))
    prompts, skipped = make_prompts(
        trace, scale=SCALE, vocab_size=vocab, max_output_tokens=OUTPUT, max_model_len=MAX_LEN
    )
    kept = [r for i, r in enumerate(trace) if i not in set(skipped)]
    server = ServerSpec(
        model=model, block_size=BLOCK, max_model_len=MAX_LEN, num_blocks=VLLM_BLOCKS,
        extra_args=["--enforce-eager"],
    )
    config = Config(PIPELINE.stem, PIPELINE, prefix_caching=False)
    WORKDIR.mkdir(exist_ok=True)
    results: dict[int, RunResult] = {}
    with fleet(config, server, 1, WORKDIR) as (engine,):
        for concurrency in CONCURRENCY:
            empty(engine.url)
            results[concurrency] = measure(
                f"{concurrency} in flight", engine.url, prompts, concurrency=concurrency,
                speedup=1.0, progress=False,
            )
    alone = results[1]
    cost = fit(
        samples(alone),
        {n: (samples(results[n]), results[n].wall_s) for n in CONCURRENCY if n > 1},
        alone.wall_s,
    )
    print(f"slice: {len(prompts)} requests, {OUTPUT} output tokens each, one engine, one core\n")
    print("| in flight | request s | prefill s/token | load s/token | decode s/token "
          "| tier ÷ vLLM | TTFT p50 ms measured (simulated) | TTFT p90 ms measured (simulated) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in CONCURRENCY:
        gain = cost.batch_speedup(n)
        summary = results[n].summary()
        sim = predicted_ttft(model, kept, cost, n)
        ratio = results[n].tier_over_vllm
        print(
            f"| {n} | {cost.request_s / gain:.4f} | {cost.prefill_token_s / gain:.2e} "
            f"| {cost.load_token_s / gain:.2e} | {cost.decode_token_s / gain:.4f} "
            f"| {'-' if ratio is None else f'{ratio:.3f}'} "
            f"| {1000 * summary['ttft_s']['p50']:.0f} ({1000 * sim[50]:.0f}) "
            f"| {1000 * summary['ttft_s']['p90']:.0f} ({1000 * sim[90]:.0f}) |"
        )
    print(f"\nfitted: {cost}")
    out = {"cost": cost.as_dict(), "runs": {n: results[n].summary() for n in CONCURRENCY}}
    (WORKDIR / "calibration.json").write_text(json.dumps(out, indent=2))
    return int(any(r.errors for r in results.values()))


if __name__ == "__main__":
    raise SystemExit(main())
