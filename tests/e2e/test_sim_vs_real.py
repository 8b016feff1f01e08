"""`kvc simulate` against reality: a scaled slice of the conversation trace through a real
engine with an offload-cpu tier, and the simulator's prediction for the same slice and
settings, served-token fraction per node within 5 percentage points."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from composer import scrape, simulate
from composer.bench import replay
from composer.bench import run as bench_run
from composer.bench import servers as bench_servers
from composer.simulate.shape import bytes_per_block_from_config
from composer.trace import read_trace
from composer.validation import load_pipeline

pytestmark = pytest.mark.e2e

TRACE = Path(__file__).parents[1] / "data" / "traces" / "mooncake-conversation_trace-500.jsonl"
REQUESTS = 300
SCALE = 16  # 512 tokens a hash id -> 32, the block size: one vLLM block per trace block
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096


def test_simulated_hit_rate_matches_a_real_engine(
    tiny_model: str,
    engine_env: dict[str, str],
    offload_pipeline: Path,
    tmp_path: Path,
    figures: Callable[[str], None],
) -> None:
    # Its 64 MiB tier is smaller than the slice's working set (~6,400 blocks of 16 KiB):
    # LRU evicts, so the prediction has to get the eviction order right, not only the sharing.
    pipeline = offload_pipeline
    trace = read_trace(TRACE, limit=REQUESTS)
    prompts, skipped = replay.make_prompts(
        trace,
        scale=SCALE,
        vocab_size=replay.vocab_size_of(tiny_model) or 512,
        max_output_tokens=4,  # outputs are not saved (save: prompt); short keeps it fast
        max_model_len=MAX_MODEL_LEN,
    )
    kept = [req for i, req in enumerate(trace) if i not in set(skipped)]
    assert len(kept) == len(prompts) > 250

    predicted = simulate.simulate(
        load_pipeline(pipeline),
        kept,
        bytes_per_block=bytes_per_block_from_config(Path(tiny_model) / "config.json", BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        trace_block_tokens=replay.trace_block_tokens(SCALE),
        exact=True,
    )
    node = next(n for n in predicted.nodes if n.id == "cpu")
    assert node.evictions > 0 and node.fraction_served > 0.05

    # One request at a time, in trace order, as the simulator replays it; vLLM's
    # own prefix cache off, so every hit is the tier's.
    config = bench_servers.Config("cpu", pipeline, prefix_caching=False)
    spec = bench_servers.ServerSpec(
        model=tiny_model,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        extra_args=["--enforce-eager"],
        env=engine_env,
    )
    with bench_servers.server(config, spec, tmp_path / "serve.log") as base:
        result = bench_run.measure("cpu", base, prompts, concurrency=1, speedup=1.0, progress=False)
        evictions = scrape.nodes(scrape.fetch(base))["cpu"].events.get("evictions", 0)
    assert result.errors == 0, [r.error for r in result.records if r.error][:3]
    assert result.prompt_tokens == predicted.prompt_tokens
    measured = result.fraction(result.node_tokens["cpu"])
    # The requests' own usage says the same (prefix cache off: every cached token is the tier's).
    assert sum(r.cached_tokens or 0 for r in result.records) == result.node_tokens["cpu"]
    assert result.connector_tokens == result.node_tokens["cpu"]
    assert evictions > 0
    gap = abs(measured - node.fraction_served)
    figures(
        f"predicted {100 * node.fraction_served:.2f}% measured {100 * measured:.2f}% "
        f"gap {100 * gap:.2f} pp ({len(prompts)} requests, {evictions:.0f} evictions)"
    )
    assert gap <= 0.05, (node.fraction_served, measured)
