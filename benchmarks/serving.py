"""Trace replay against real servers (``kvc bench``'s code): the scaled conversation trace
at a fixed concurrency, with vLLM's own KV cache too small for its working set.

Four configurations, one server each, the same prompts: no connector and no
prefix cache; vLLM's prefix cache only; an offload-cpu tier; offload-cpu in
front of LMCache (``benchmarks/serving/*.yaml``). Prints the markdown table and the
TTFT p50/p90 and throughput ratios of each configuration to the first, and
writes ``kvc-bench-serving/`` (table, every request as JSON, TTFT CDF PNG).

Environment: ``KVC_BENCH_TRACE`` (default: the 500-request slice in
tests/data/traces, or ``../shared/traces/mooncake-conversation_trace.jsonl``
when given), ``KVC_BENCH_REQUESTS`` (400), ``KVC_BENCH_CONCURRENCY`` (8),
``KVC_BENCH_VLLM_BLOCKS`` (256 blocks of 32 tokens for vLLM's own cache).
A 2-core machine shared with other work is noisy; compare runs side by side.
"""

from __future__ import annotations

import os
from pathlib import Path

from composer.bench import report as bench_report
from composer.bench import run as bench_run
from composer.bench import servers as bench_servers
from composer.bench import spec as bench_spec
from composer.testing.tiny_model import build_tiny_model
from composer.trace import read_trace

HERE = Path(__file__).parent
ROOT = HERE.parent
TRACE = os.environ.get(
    "KVC_BENCH_TRACE", str(ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl")
)
REQUESTS = int(os.environ.get("KVC_BENCH_REQUESTS", "400"))
CONCURRENCY = int(os.environ.get("KVC_BENCH_CONCURRENCY", "8"))
VLLM_BLOCKS = int(os.environ.get("KVC_BENCH_VLLM_BLOCKS", "256"))
CONFIGS = [
    "none",
    "prefix",
    str(HERE / "serving/offload-cpu.yaml"),
    str(HERE / "serving/offload-cpu-lmcache.yaml"),
]


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def main() -> int:
    model = str(build_tiny_model())
    spec = bench_spec.BenchSpec(
        trace=read_trace(TRACE, limit=REQUESTS),
        configs=[bench_servers.Config.parse(c) for c in CONFIGS],
        server=bench_servers.ServerSpec(
            model=model, num_blocks=VLLM_BLOCKS, extra_args=["--enforce-eager"]
        ),
        scale=16,
        concurrency=CONCURRENCY,
        max_output_tokens=16,
        workdir=Path("kvc-bench-serving"),
    )
    results = bench_run.run(spec)
    bench_report.write_report(results, spec.workdir)
    print(bench_report.markdown_table(results))
    base = results[0].summary()
    print(f"\nratios to {base['config']} (lower TTFT is better, higher throughput is better):")
    for result in results[1:]:
        s = result.summary()
        print(
            f"  {s['config']}: TTFT p50 {_ratio(s['ttft_s']['p50'], base['ttft_s']['p50'])}, "
            f"p90 {_ratio(s['ttft_s']['p90'], base['ttft_s']['p90'])}, "
            f"throughput {_ratio(s['requests_per_s'], base['requests_per_s'])}"
        )
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
