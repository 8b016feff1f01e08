"""How long ``kvc simulate`` takes at scale, each run as a ratio to the one-engine run.

The whole Mooncake conversation trace (12,031 requests; the shipped 500-request
slice where the shared trace is absent) through ``examples/cpu-offload.yaml``:

* one engine, ``--bytes-per-block 16KiB`` (the reference, 1.0);
* one engine, a Gemma-3-12B-shaped hybrid (``--model-config``: 40 sliding-window
  layers of 1024 tokens in five groups, 8 full-attention layers in one);
* ``examples/tiers-ranges.yaml`` with that hybrid, ``--sweep load_policy=`` three values;
* ``--fleet 4``, ``16`` and ``64`` under ``kv_aware-tiers``;
* ``--fleet 100`` under every policy.

Each run is the command as a user runs it (a fresh process: start-up included),
timed on this machine; the ratios, not the seconds, are what carries over.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
SHARED = ROOT.parent / "shared/traces/mooncake-conversation_trace.jsonl"
SLICE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
TRACE = SHARED if SHARED.exists() else SLICE
OFFLOAD = ROOT / "examples/cpu-offload.yaml"
RANGES = ROOT / "examples/tiers-ranges.yaml"
#: Gemma-3-12B's KV shape: 48 layers, every sixth full attention, the rest a 1024-token window.
GEMMA3_12B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "bfloat16",
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "hidden_size": 3840, "sliding_window": 1024,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                    for i in range(48)],
}


def timed(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "composer.cli", "simulate", *args],
        check=True, stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "config.json"
        model.write_text(json.dumps(GEMMA3_12B))
        trace, block = str(TRACE), ("--bytes-per-block", "16KiB")
        runs = {
            "one engine": (str(OFFLOAD), trace, *block),
            "one engine, hybrid (Gemma-3-12B shape)": (str(OFFLOAD), trace, "--model-config",
                                                        str(model)),
            "tiers-ranges, hybrid, --sweep load_policy= 3 values": (
                str(RANGES), trace, "--model-config", str(model), "--sweep",
                "load_policy=first_hit,longest_hit,ranges", "-o", f"{tmp}/sweep.txt",
            ),
            **{
                f"--fleet {n} --router kv_aware-tiers": (
                    str(OFFLOAD), trace, *block, "--fleet", str(n), "--router", "kv_aware-tiers"
                )
                for n in (4, 16, 64)
            },
            "--fleet 100, every policy": (str(OFFLOAD), trace, *block, "--fleet", "100"),
        }
        seconds = {name: timed(*args) for name, args in runs.items()}
    base = seconds["one engine"]
    print(f"kvc simulate on {TRACE.name}, times as a ratio to one engine ({base:.2f} s here)\n")
    print("| run | ratio | seconds here |")
    print("| --- | ---: | ---: |")
    for name, s in seconds.items():
        print(f"| {name} | {s / base:.1f} | {s:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
