"""How long ``kvc simulate`` takes at scale, each run as a ratio to the one-engine run.

The whole Mooncake conversation trace (12,031 requests; the shipped 500-request
slice where the shared trace is absent) through ``examples/cpu-offload.yaml``:

* one engine, ``--bytes-per-block 16KiB`` (the reference, 1.0);
* one engine, a Gemma-3-12B-shaped hybrid (``--model-config``: 40 sliding-window
  layers of 1024 tokens in five groups, 8 full-attention layers in one);
* ``examples/tiers-ranges.yaml`` with that hybrid, ``--sweep load_policy=`` three values;
* ``--fleet 4``, ``16`` and ``64`` under ``kv_aware-tiers``;
* ``--fleet 100`` under every policy;
* hybrids of the Gemma-2-9B, Gemma-3-1B and Gemma-3-12B shapes and a 4-layer
  Gemma-3-like model, at their own windows and at windows from 32 to 700 tokens
  (inside a trace block), each as a ratio to the one-group run at the same bytes
  per block (the model's slot): a hybrid's work is the blocks it keeps, so the
  ratio should stay under 2 whatever the window.

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


def _gemma3(layers: int, kv_heads: int, hidden: int, window: int) -> dict[str, object]:
    """A Gemma-3 config.json's KV shape: every sixth layer full attention."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "dtype": "bfloat16", "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": kv_heads, "head_dim": 256, "hidden_size": hidden,
        "sliding_window": window,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)],
    }


#: Each shape's config.json, and the windows it is run at (its own first).
HYBRIDS: dict[str, tuple[dict[str, object], tuple[int, ...]]] = {
    # 42 layers alternating (transformers' default for gemma2), 8 KV heads of 256.
    "Gemma-2-9B": ({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "dtype": "bfloat16",
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "hidden_size": 3584, "sliding_window": 4096,
    }, (4096, 700)),
    "Gemma-3-1B": (_gemma3(26, 1, 1152, 512), (512, 64)),
    "Gemma-3-12B": (GEMMA3_12B, (1024, 32)),
    # The small model: 4 layers, the last full attention, one KV head of 64.
    "4-layer Gemma-3-like": ({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "dtype": "bfloat16", "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 64, "hidden_size": 256, "sliding_window": 64,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    }, (64,)),
}


def hybrids(tmp: str, trace: str) -> list[tuple[str, int, float, float]]:
    """(shape, window, seconds, seconds of the one-group run at its slot's bytes)."""
    from composer.simulate.shape import model_shape

    out = []
    for name, (config, windows) in HYBRIDS.items():
        paths = []
        for window in windows:
            path = Path(tmp) / f"{name.replace(' ', '_')}-{window}.json"
            path.write_text(json.dumps({**config, "sliding_window": window}))
            paths.append(path)
        slot = model_shape(paths[0], 32).bytes_per_block
        one = timed(str(OFFLOAD), trace, "--bytes-per-block", str(slot))
        for window, path in zip(windows, paths, strict=True):
            out.append((name, window, timed(str(OFFLOAD), trace, "--model-config", str(path)), one))
    return out


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
        shapes = hybrids(tmp, trace)
    base = seconds["one engine"]
    print(f"kvc simulate on {TRACE.name}, times as a ratio to one engine ({base:.2f} s here)\n")
    print("| run | ratio | seconds here |")
    print("| --- | ---: | ---: |")
    for name, s in seconds.items():
        print(f"| {name} | {s / base:.1f} | {s:.1f} |")
    print("\nhybrids, each as a ratio to one engine of one group at its slot's bytes per block\n")
    print("| shape | window | ratio | seconds here (one group) |")
    print("| --- | ---: | ---: | ---: |")
    for name, window, s, one in shapes:
        print(f"| {name} | {window} | {s / one:.1f} | {s:.1f} ({one:.1f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
