"""Two tiers, one request: ``first_hit`` / ``longest_hit`` vs ``ranges`` vs ``ranges`` +
promotion, and the fast tier's eviction (``lru``/``arc``) and admission
(``store_threshold`` 1/2), side by side.

The pipeline is ``examples/tiers-ranges.yaml``: ``fast``, a small offload-cpu
tier, in front of ``slow``, a larger one. Each variant changes one setting.

1. ``kvc simulate`` on the whole Mooncake conversation trace (12,031 requests),
   for a model whose KV block is 4 MiB (an 8B model's, 32 tokens): prompt
   tokens served by each tier and bytes each copied in, ``fast`` smaller than
   the trace's working set.
2. ``kvc bench`` on a slice (``benchmarks/router_fleet.py``'s: the
   conversations that come back among the trace's first 1,200 requests,
   lengths scaled by 16), the tiny model, both tiers smaller than the slice's
   working set, one request at a time, each variant on a fresh server with
   vLLM's prefix cache off: TTFT, tokens served per tier, and ``kvc
   simulate``'s prediction of the slice beside each measured fraction.

Both tiers are host memory here, so a block costs the same from either: the
bench measures what each policy serves, not a slow tier's latency.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from benchmarks.router_fleet import BLOCK, MAX_LEN, OUTPUT, SCALE, TRACE, fleet_slice
from composer import load_pipeline
from composer.bench import report as bench_report
from composer.bench import run as bench_run
from composer.bench import spec as bench_spec
from composer.bench.servers import Config, ServerSpec
from composer.simulate import simulate
from composer.simulate.shape import model_shape
from composer.testing.tiny_model import build_tiny_model
from composer.trace import read_trace

ROOT = Path(__file__).parent.parent
#: Each variant this many times, in alternating order (a drifting machine load
#: then favours none: its TTFT is otherwise the order's as much as the policy's).
ROUNDS = int(os.environ.get("KVC_BENCH_ROUNDS", "1"))
EXAMPLE = ROOT / "examples/tiers-ranges.yaml"
WORKDIR = Path("kvc-bench-tiers")
#: The whole trace's simulation: an 8B model's block, tiers of these sizes.
SIM_BLOCK_BYTES, SIM_FAST, SIM_SLOW = 4 * 1024**2, "256GiB", "1TiB"
#: The slice's tiers (tiny model: 16 KiB blocks; the slice's prompts hold ~130 MiB).
SLICE_FAST, SLICE_SLOW = "8MiB", "32MiB"

#: Variant name -> (load_policy, fast's config changes; promote: on_hit unless named).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "first_hit": ("first_hit", {}),
    "longest_hit": ("longest_hit", {}),
    "ranges,promote=never": ("ranges", {"promote": "never"}),
    "ranges": ("ranges", {}),
    "ranges,eviction=arc": ("ranges", {"eviction": "arc"}),
    "ranges,store_threshold=2": ("ranges", {"store_threshold": 2}),
}


def variant(name: str, fast: str, slow: str) -> dict[str, Any]:
    data = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    policy, changes = VARIANTS[name]
    data["load_policy"] = policy
    data["nodes"]["fast"]["config"].update(capacity=fast, **changes)
    data["nodes"]["slow"]["config"].update(capacity=slow)
    return data


def _gib(n: float) -> str:
    return f"{n / 1024**3:,.0f} GiB"


def simulated(trace_path: str, fast: str, slow: str, **kwargs: Any) -> dict[str, Any]:
    trace = read_trace(trace_path)
    return {
        name: simulate(load_pipeline(variant(name, fast, slow)), trace, **kwargs)
        for name in VARIANTS
    }


def print_simulation() -> None:
    results = simulated(TRACE, SIM_FAST, SIM_SLOW, bytes_per_block=SIM_BLOCK_BYTES)
    print(
        f"kvc simulate, {TRACE}: fast {SIM_FAST}, slow {SIM_SLOW}, "
        f"{SIM_BLOCK_BYTES // 1024**2} MiB blocks of 32 tokens\n"
    )
    print(
        "| variant | served | by fast | by slow | loaded from fast | loaded from slow "
        "| saved into fast |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, result in results.items():
        fast, slow = (next(n for n in result.nodes if n.id == i) for i in ("fast", "slow"))
        print(
            f"| {name} | {100 * result.fraction_served:.1f}% | {100 * fast.fraction_served:.1f}% "
            f"| {100 * slow.fraction_served:.1f}% | {_gib(fast.bytes_loaded)} "
            f"| {_gib(slow.bytes_loaded)} | {_gib(fast.bytes_saved)} |"
        )


def main() -> int:
    print_simulation()
    model = str(build_tiny_model())
    slice_path = fleet_slice(model, WORKDIR / "slice.jsonl")
    sliced = read_trace(slice_path)
    configs = []
    for i, name in enumerate(VARIANTS):
        path = WORKDIR / f"{i}-{name.replace(',', '-')}.yaml"
        path.write_text(yaml.safe_dump(variant(name, SLICE_FAST, SLICE_SLOW), sort_keys=False))
        # No vLLM prefix cache: every hit is a tier's, as in the simulation.
        configs.append(Config(name, path, prefix_caching=False))
    first = configs[0].pipeline
    assert first is not None
    pipeline = load_pipeline(first)  # (every variant: the same model shape)
    shape = model_shape(model, BLOCK, pipeline)
    predicted = simulated(
        str(slice_path),
        SLICE_FAST,
        SLICE_SLOW,
        bytes_per_block=shape.bytes_per_block,
        block_size=BLOCK,
        trace_block_tokens=512 // SCALE,
        groups=shape.groups,
    )
    spec = bench_spec.BenchSpec(
        trace=sliced,
        configs=configs,
        server=ServerSpec(
            model=model, block_size=BLOCK, max_model_len=MAX_LEN, extra_args=["--enforce-eager"]
        ),
        scale=SCALE,
        concurrency=1,
        max_output_tokens=OUTPUT,
        workdir=WORKDIR,
        progress=False,
        rounds=ROUNDS,
    )
    results = bench_run.run(spec)
    bench_report.write_report(results, WORKDIR, plot=False)
    print(f"\nkvc bench, {len(sliced)} requests of the trace, one at a time\n")
    print(bench_report.markdown_table(results))
    print("\nserved per tier, measured (kvc simulate's prediction of the slice):")
    for result in results:
        sim = predicted[result.config]
        parts = []
        for node in ("fast", "slow"):
            measured = result.fraction(result.node_tokens.get(node, 0.0))
            want = next(n for n in sim.nodes if n.id == node).fraction_served
            loaded = result.node_bytes_loaded.get(node, 0.0) / 1024**2
            parts.append(
                f"{node} {100 * measured:.1f}% ({100 * want:.1f}%, "
                f"{100 * (measured - want):+.1f} pp; {loaded:,.0f} MiB loaded)"
            )
        print(f"  {result.config}: " + "; ".join(parts))
    return int(any(r.errors for r in results))


if __name__ == "__main__":
    raise SystemExit(main())
