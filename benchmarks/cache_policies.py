"""Cache policies on traces, predicted and measured side by side: two tenants with and
without ``quotas``, paused agent sessions with a TTL (and a shorter one, and plain
LRU), a pinned system prompt with and without its pin
(:mod:`composer.testing.policy_traces`).

1. ``kvc simulate`` on the whole Mooncake conversation trace as the chat tenant
   (12,031 requests), a 33-id one-off scan prompt after each, for a model
   whose KV block is 4 MiB (an 8B model's, 32 tokens): the chat tenant's
   served share alone, beside the scan without quotas, and with quotas of 0.7
   and 0.9, on the same memory, for tiers of several sizes.
2. One real engine (the tiny model, vLLM's prefix cache off) with a tier per
   run, each run through its own tier: every tenant's served share measured
   by the requests' usage, beside ``kvc simulate``'s prediction. The chat
   tenant is the conversations that come back among the first 500 requests
   of the trace (its ``tests/data`` slice), lengths scaled by 16.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.router_fleet import TRACE
from composer.bench import replay
from composer.bench.servers import Config, ServerSpec, server
from composer.simulate import simulate
from composer.simulate.shape import bytes_per_block_from_config
from composer.testing.policy_traces import SYNC, measure, predict, runs, two_tenants
from composer.testing.tiny_model import build_tiny_model
from composer.trace import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    conversation,
    multi_turn,
    read_trace,
)
from composer.validation import load_pipeline

ROOT = Path(__file__).parent.parent
SLICE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
WORKDIR = Path("kvc-bench-cache-policies")
SCALE, BLOCK, MAX_LEN, OUTPUT = 16, 32, 4096, 4
#: The whole trace's simulation: an 8B model's block (4 MiB of 32 tokens), tiers of
#: these fractions of what the chat tenant ever holds.
SIM_BLOCK_BYTES, SIM_BLOCK_TOKENS = 4 * 1024**2, 32
SIM_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
SCAN_BLOCKS = 32


def print_simulation() -> None:
    """The chat tenant's served share on tiers of several sizes (fractions of what it
    ever holds), alone, beside the scan, and beside it with quotas of 0.7 and 0.9."""
    alone, mixed, blocks, share = two_tenants(read_trace(TRACE), scan_blocks=SCAN_BLOCKS)
    footprint = int((blocks - 1) * share)  # in trace ids of 512 tokens: 16 blocks each
    per_id = MOONCAKE_BLOCK_TOKENS // SIM_BLOCK_TOKENS

    def chat(trace: list[TraceRequest], fraction: float, **config: object) -> str:
        capacity = int(footprint * fraction) * per_id * SIM_BLOCK_BYTES
        node = {"plugin": "offload-cpu", "config": {"capacity": capacity, **config}}
        pipeline = load_pipeline({"version": 1, "nodes": {"cpu": node}})
        result = simulate(pipeline, trace, bytes_per_block=SIM_BLOCK_BYTES)
        return f"{100 * result.tenants['chat'].fraction_served:.1f}%"

    print(
        f"kvc simulate, {TRACE} ({len(alone):,} requests) as the chat tenant, a "
        f"{SCAN_BLOCKS + 1}-id one-off scan prompt after each; {SIM_BLOCK_BYTES // 2**20} MiB "
        f"blocks of {SIM_BLOCK_TOKENS} tokens; the chat tenant ever holds "
        f"{footprint * per_id:,} blocks\n"
    )
    print(
        "| tier (of what chat holds) | chat alone | + scan | + scan, quotas chat 0.7 "
        "| + scan, quotas chat 0.9 |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for fraction in SIM_FRACTIONS:
        cells = [
            chat(alone, fraction),
            chat(mixed, fraction),
            *(chat(mixed, fraction, quotas={"chat": q}) for q in (0.7, 0.9)),
        ]
        print(f"| {fraction:.0%} | " + " | ".join(cells) + " |")
    print()


def main() -> int:
    print_simulation()
    model = str(build_tiny_model())
    slot = bytes_per_block_from_config(Path(model) / "config.json", BLOCK)
    # The conversations whose every turn fits the tiny model (lengths divided by SCALE).
    chat = multi_turn(read_trace(SLICE))
    too_long = {conversation(r) for r in chat if r.input_length // SCALE + OUTPUT > MAX_LEN - BLOCK}
    all_runs = runs([r for r in chat if conversation(r) not in too_long])
    nodes = {run.name: run.node(slot) for run in all_runs}
    WORKDIR.mkdir(exist_ok=True)
    pipeline = WORKDIR / "tiers.yaml"
    pipeline.write_text(yaml.safe_dump({"version": 1, "nodes": nodes}, sort_keys=False))
    spec = ServerSpec(
        model=model, block_size=BLOCK, max_model_len=MAX_LEN, extra_args=["--enforce-eager"]
    )
    vocab = replay.vocab_size_of(model) or 512
    with server(
        Config("tiers", pipeline, prefix_caching=False), spec, WORKDIR / "serve.log"
    ) as base:
        measured = measure(
            base, all_runs, vocab=vocab, scale=SCALE, output=OUTPUT, max_model_len=MAX_LEN
        )
    print(f"one engine, a tier per run ({SYNC['save_mode']} saves); {SLICE.name}'s conversations")
    print("\n| run | tier | tenant | measured | predicted | gap (points) |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for run in all_runs:
        predicted = predict(run, slot, BLOCK, replay.trace_block_tokens(SCALE))
        for tenant, p in sorted(predicted.items()):
            m = measured[run.name][tenant]
            print(
                f"| {run.name} | {run.blocks} blocks | {tenant.split('.', 1)[1]} "
                f"| {100 * m:.1f}% | {100 * p:.1f}% | {100 * abs(m - p):.2f} |"
            )
    return 0
