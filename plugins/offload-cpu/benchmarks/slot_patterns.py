"""Steady-state slot patterns of the offload-cpu tier: runs of consecutive slots per batch.

``make bench`` runs :func:`main` (``python -m benchmarks slot_patterns``: this
one alone; ``python plugins/offload-cpu/benchmarks/slot_patterns.py --help``: its
options).

Replays the Mooncake conversation trace (``shared/traces``; the shipped
500-request slice where it is absent) block by block (a slot is one vLLM block
of one group) through ``kvc simulate``'s model of the node on the tier's own
slot-numbering index (:class:`kvc_offload_cpu.slot_patterns.SlotRecorder`), with
pools of a share of the slots the trace's distinct blocks need (so that they
are full for most of the run), and prints, for saves and loads, per entry size
(1: a plain model; 2 and 3: a hybrid model's bundles, two full-attention groups
and three sliding-window groups), over the batches that start on a full pool:
batches, mean blocks a batch, runs of consecutive slots a batch (mean, p50,
p90, in the order the tier lists them; and the mean with the slots sorted),
the share of blocks in runs of >= 8 and >= 32 slots, and the share of batches
that are one run.

Counted, not timed: the figures are the index's and the same on any machine;
the bytes of a slot and the number of regions (one, or one per layer) do not
change them. A batch here is a request's (a real prefill in chunks saves a
long prompt in several steps' batches, each a slice of it). ``--check``
replays the plain model with ``kvc simulate --exact`` too and compares hits and
evictions (the replay here must be the simulator's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.slot_patterns import SlotRecorder
from pydantic import ByteSize

from composer import SimKVGroup

ROOT = Path(__file__).resolve().parents[3]
SHARED = ROOT.parent / "shared/traces/mooncake-conversation_trace.jsonl"
SLICE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
#: Tokens of one of the trace's hash ids.
MOONCAKE_BLOCK = 512
#: vLLM's default block size on a GPU.
BLOCK = 16
POOLS = (0.1, 0.25, 0.5)
#: The hybrid model's sliding window (tokens): Gemma-3-12B's and 27B's.
WINDOW = 1024


class Request(NamedTuple):
    prompt_tokens: int
    #: Every full block of the request's sequence (KV exists for all but the last token).
    keys: list[bytes]
    #: Blocks a hit may serve (at least one prompt token is computed).
    limit: int


class TraceKeys:
    """Block keys of trace requests, as ``kvc simulate`` makes them (one tenant): block
    ``k``'s key names the chain of hash ids up to the trace block holding its last
    token and where in it the block ends; blocks past the prompt's full trace
    blocks are the request's own."""

    def __init__(self, block_size: int, trace_block_tokens: int) -> None:
        if trace_block_tokens % block_size:
            raise ValueError("the block size must divide the trace block tokens")
        self.block_size, self.tbt = block_size, trace_block_tokens
        self.chains: dict[tuple[int, int], int] = {}
        self.unique = 0

    def request(self, line: dict[str, Any]) -> Request:
        bs, tbt = self.block_size, self.tbt
        full, rest = divmod(int(line["input_length"]), MOONCAKE_BLOCK)
        prompt = full * tbt + rest * tbt // MOONCAKE_BLOCK
        total = prompt + int(line["output_length"]) * tbt // MOONCAKE_BLOCK
        chains, parent, ids = self.chains, 0, []
        for hid in line["hash_ids"][:full]:
            parent = chains.get((parent, hid)) or chains.setdefault((parent, hid), len(chains) + 1)
            ids.append(parent)
        keys = []
        for k in range(max(prompt, total - 1) // bs):
            end = (k + 1) * bs
            if end <= full * tbt:
                j = (end - 1) // tbt
                keys.append(((ids[j] << 20) | (end - j * tbt)).to_bytes(8, "little"))
            else:
                self.unique += 1
                keys.append(((1 << 63) | self.unique).to_bytes(8, "little"))
        return Request(prompt, keys, (prompt - 1) // bs)


def read(path: Path, limit: int | None) -> list[dict[str, Any]]:
    lines = []
    with path.open() as f:
        for text in f:
            if text.strip():
                lines.append(json.loads(text))
                if limit is not None and len(lines) >= limit:
                    break
    return lines


def distinct_blocks(trace: Sequence[dict[str, Any]], block_size: int, tbt: int) -> int:
    """Distinct prompt blocks of the trace (what ``save: prompt`` can store)."""
    keys = TraceKeys(block_size, tbt)
    own = 0
    for line in trace:
        r = keys.request(line)
        full = len(line["hash_ids"][: int(line["input_length"]) // MOONCAKE_BLOCK])
        own += r.prompt_tokens // block_size - full * tbt // block_size
    return len(keys.chains) * (tbt // block_size) + own


def groups(model: str, window: int) -> list[SimKVGroup]:
    if model == "plain":
        return [SimKVGroup("attention", 1)]
    return [SimKVGroup("attention", 1)] * 2 + [SimKVGroup("sliding_window", 1, window)] * 3


def replay(
    trace: Sequence[dict[str, Any]], slots: int, model: str, args: argparse.Namespace
) -> tuple[SlotRecorder, int]:
    """The trace through a recorder of ``slots`` slots; the recorder and its hits."""
    config = OffloadCPUConfig(capacity=ByteSize(slots), eviction=args.eviction)
    rec = SlotRecorder(
        config,
        block_size=args.block_size,
        bytes_per_block=1,
        groups=groups(model, args.window),
        dealt=not args.no_deal,
    )
    keys = TraceKeys(args.block_size, args.trace_block_tokens)
    hits = 0
    for line in trace:
        r = keys.request(line)
        hits += rec.serve(r.keys, r.prompt_tokens, r.limit) > 0
    return rec, hits


def simulated(trace_path: Path, requests: int, slots: int, args: argparse.Namespace) -> Any:
    """``kvc simulate --exact``'s figures of the plain model (the same replay)."""
    kvc = Path(sys.executable).parent / "kvc"
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Path(tmp, "p.yaml")
        pipeline.write_text(
            "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n"
            f"    config: {{capacity: {slots}, eviction: {args.eviction}}}\n"
        )
        trace = Path(tmp, "t.jsonl")
        with trace_path.open() as src, trace.open("w") as dst:
            for i, line in enumerate(src):
                if i >= requests:
                    break
                dst.write(line)
        out = subprocess.run(
            [
                str(kvc),
                "simulate",
                str(pipeline),
                str(trace),
                "--exact",
                "--json",
                "--block-size",
                str(args.block_size),
                "--bytes-per-block",
                "1",
                "--trace-block-tokens",
                str(args.trace_block_tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(out.stdout)["nodes"][0]


def rows(rec: SlotRecorder) -> Iterator[str]:
    for s in rec.summaries():
        yield (
            f"| {s['kind']} | {s['size'] or 'all'} | {s['batches']:,} | "
            f"{s['blocks_per_batch']:.1f} | "
            f"{s['runs_mean']:.2f} | {s['runs_p50']:.0f} | {s['runs_p90']:.0f} | "
            f"{s['sorted_runs_mean']:.2f} | {s['in_runs_8']:.1%} | {s['in_runs_32']:.1%} | "
            f"{s['one_run']:.1%} |"
        )


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--trace",
        type=Path,
        default=SHARED if SHARED.exists() else SLICE,
        help="Mooncake-format JSONL trace (default: the conversation trace)",
    )
    ap.add_argument("--requests", type=int, default=None, help="its first N requests only")
    ap.add_argument("--block-size", type=int, default=BLOCK, help="vLLM block size (tokens)")
    ap.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK,
        help="tokens one hash id stands for (fewer: a scaled replay)",
    )
    ap.add_argument(
        "--pools",
        default=",".join(map(str, POOLS)),
        help="pool sizes, as shares of the slots of the trace's distinct blocks",
    )
    ap.add_argument(
        "--models",
        default="plain,hybrid",
        help="plain (one group) and/or hybrid (2 full-attention + 3 window groups)",
    )
    ap.add_argument("--window", type=int, default=WINDOW, help="the hybrid's window (tokens)")
    ap.add_argument("--eviction", default="lru", help="the eviction policy")
    ap.add_argument(
        "--check",
        action="store_true",
        help="compare the plain replay's hits and evictions with kvc simulate --exact",
    )
    ap.add_argument(
        "--no-deal",
        action="store_true",
        help="slots as allocated, not dealt bundle by bundle (the tier before it dealt them)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse([] if argv is None else argv)
    trace = read(args.trace, args.requests)
    distinct = distinct_blocks(trace, args.block_size, args.trace_block_tokens)
    print(
        f"{args.trace.name}: {len(trace):,} requests, {distinct:,} distinct prompt blocks of "
        f"{args.block_size} tokens; eviction {args.eviction}; batches that start on a full pool"
    )
    print(
        "| kind | entry slots | batches | blocks/batch | runs/batch mean | p50 | p90 | "
        "sorted mean | in runs >= 8 | in runs >= 32 | one run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    out: list[dict[str, Any]] = []
    failed = 0
    for model in args.models.split(","):
        per_position = len(groups(model, args.window))
        for share in (float(x) for x in args.pools.split(",")):
            slots = int(share * distinct * per_position)
            t0 = time.perf_counter()
            rec, hits = replay(trace, slots, model, args)
            print(
                f"| **{model}, pool {share:.0%} ({slots:,} slots): {hits:,} hits, "
                f"{rec.steady_requests:,} of {rec.requests:,} requests on a full pool, "
                f"{time.perf_counter() - t0:.0f} s** |||||||||||"
            )
            for line in rows(rec):
                print(line, flush=True)
            out += [{"model": model, "pool": share, "slots": slots, **s} for s in rec.summaries()]
            if args.check and model == "plain":
                sim = simulated(args.trace, len(trace), slots, args)
                same = (sim["hits"], sim["evictions"]) == (hits, rec.index.evictions)
                failed += not same
                print(
                    f"  kvc simulate --exact: {sim['hits']:,} hits, {sim['evictions']:,} "
                    f"evictions; here {hits:,}, {rec.index.evictions:,}: "
                    f"{'the same' if same else 'DIFFERENT'}"
                )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
