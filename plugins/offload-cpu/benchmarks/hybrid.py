"""offload-cpu on a sliding-window hybrid model: tier hit vs vLLM's own cache hit,
bytes the tier stores, and vLLM's KV capacity with and without the pipeline.

A random-weight model with Gemma-3-1B's layers (5 sliding-window layers of 512
tokens : 1 full-attention layer, 4 heads / 1 KV head x 256; 6 of its 26 layers
by default, see ``LAYERS``),
vLLM's hybrid KV cache manager on (one KV cache group per kind of layer), the
offload-cpu node with its default ``window_retention`` (or
``KVC_BENCH_HYBRID_RETENTION``). A retention no longer than the window (512)
keeps every block of the window layers: no saving; 1024 keeps about half.

Per prompt length (about 1k, 4k and 16k tokens) one engine, vLLM's prefix
cache on, the same scheme as ``benchmarks/ttft.py``: per prompt, compute
(first time), vLLM hit (not counted: it runs beside the tier's background save),
vLLM hit, reset vLLM's prefix cache, tier hit, vLLM hit again. Medians, with
every sample and the load average.

* TTFT tier hit / TTFT vLLM hit (target <= 1.05).
* Bytes the tier stored per request / bytes of a full-attention model of the
  same shape (every layer keeps every token of the stored blocks). The stored
  bytes are the node's own ``bytes_saved`` counter, summed over the engine's
  "KV Transfer metrics" lines (the stat logger runs every step at debug level,
  see :func:`logging_config`); only the compute rounds store anything.
* vLLM's KV capacity ("KV cache size: N tokens") with the pipeline / a plain
  engine without a connector at the same settings (target 1.00).

Environment: ``KVC_BENCH_THREADS`` (VLLM_CPU_OMP_THREADS_BIND, default 0-1),
``KVC_BENCH_HYBRID_REPEATS`` (prompts per length, default 2),
``KVC_BENCH_HYBRID_LAYERS`` (layers, keeping the 5:1 pattern; default 6, as
Gemma-3-1B's 26 are too slow here),
``KVC_BENCH_HYBRID_RETENTION`` (the node's ``window_retention``, tokens),
``KVC_BENCH_HYBRID_LENGTHS`` (prompt words, comma-separated; a word is about
one token; default 1024,4096,16384).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from composer import kv_transfer_config, load_pipeline
from composer.testing.engine import EngineFailed, EngineResult, EngineSpec, run_engine
from composer.testing.tiny_model import (
    GEMMA3_1B_SHAPE,
    TinyModelSpec,
    build_tiny_model,
    make_prompts,
)

THREADS = os.environ.get("KVC_BENCH_THREADS", "0-1")
REPEATS = int(os.environ.get("KVC_BENCH_HYBRID_REPEATS", "2"))
#: Gemma-3-1B has 26; on 2 CPU cores an engine with 26 took ~10 min to start
#: (compiling) and 2.5 min for a 1k-token prompt, so 6 (5 sliding : 1 full, the
#: same layers) by default: ~35 s per 1k tokens computed, ~5 min per engine start.
LAYERS = int(os.environ.get("KVC_BENCH_HYBRID_LAYERS", "6"))
LENGTHS = tuple(
    int(x)
    for x in os.environ.get("KVC_BENCH_HYBRID_LENGTHS", "1024,4096,16384").split(",")
    if x.strip()
)
BLOCK = 32
#: The same for every engine, so that the KV capacities compare.
MAX_MODEL_LEN = 20480
KV_CACHE_GIB = 2
CAPACITY = "2GiB"
#: The node's window_retention (tokens); unset: the plugin's default.
RETENTION = os.environ.get("KVC_BENCH_HYBRID_RETENTION", "")


def shape(layers: int = LAYERS) -> TinyModelSpec:
    """Gemma-3-1B's shape with ``layers`` layers, every sixth one full attention."""
    kinds = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers))
    return dataclasses.replace(GEMMA3_1B_SHAPE, layers=layers, layer_types=kinds)


def full_attention_bytes_per_token(spec: TinyModelSpec) -> int:
    """KV bytes of one token in every layer (bf16 K and V), as a full-attention model keeps."""
    head_dim = spec.head_dim or spec.hidden // spec.heads
    return spec.layers * 2 * spec.kv_heads * head_dim * 2


def retention() -> str:
    """The node's window_retention, as the bench sets it."""
    if RETENTION:
        return f"{int(RETENTION)} tokens"
    from kvc_offload_cpu.config import OffloadCPUConfig

    return f"{OffloadCPUConfig().window_retention} tokens (the default)"


def pipeline() -> dict[str, Any]:
    config: dict[str, Any] = {"capacity": CAPACITY}
    if RETENTION:
        config["window_retention"] = int(RETENTION)
    node = {"plugin": "offload-cpu", "config": config}
    source = {"version": 1, "annotate_outputs": True, "nodes": {"cpu": node}}
    return kv_transfer_config(load_pipeline(source))


def logging_config(folder: Path) -> Path:
    """vLLM's default logging, plus its stat logger at debug level.

    The stat logger prints the connector's counters at debug level when the
    engine looks idle, e.g. for the steps that only finish a background save;
    its interval is set to (almost) every step by the caller.
    """
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = json.loads(json.dumps(DEFAULT_LOGGING_CONFIG))
    config["handlers"]["vllm"]["level"] = "DEBUG"
    config["loggers"]["vllm.v1.metrics.loggers"] = {
        "handlers": ["vllm"],
        "level": "DEBUG",
        "propagate": False,
    }
    path = folder / "vllm-logging.json"
    path.write_text(json.dumps(config))
    return path


def engine_env(folder: Path) -> dict[str, str]:
    return {
        "VLLM_LOGGING_CONFIG_PATH": str(logging_config(folder)),
        "VLLM_LOG_STATS_INTERVAL": "0.001",
    }


# -- reading the engine's log ------------------------------------------------- #


def kv_capacity(log: str) -> int:
    found = re.search(r"KV cache size: ([\d,]+) tokens", log)
    if not found:
        raise RuntimeError("vLLM did not log its KV cache size")
    return int(found.group(1).replace(",", ""))


def group_sizes(log: str) -> str:
    found = re.search(r"kv cache group sizes \(([\d, ]+)\)", log)
    return found.group(1) if found else "?"


def saved_bytes(log: str, node: str = "cpu") -> int:
    """The node's ``bytes_saved``, summed over every "KV Transfer metrics" line."""
    pattern = re.compile(rf"(?:^|[ ,]){re.escape(node)}\.bytes_saved=([\d.]+)")
    total = 0.0
    for line in log.splitlines():
        if "KV Transfer metrics" in line:
            total += sum(float(m) for m in pattern.findall(line))
    return int(total)


def log_field(log: str, event: str, name: str) -> str:
    """``name=value`` of the first structured log line of ``event``."""
    for line in log.splitlines():
        if event in line:
            found = re.search(rf"\b{name}=(\S+)", line)
            if found:
                return found.group(1).strip("'\",")
    return "?"


# -- measuring ------------------------------------------------------------------ #


def measure_length(model: str, spec: TinyModelSpec, words: int, repeats: int) -> dict[str, Any]:
    """One engine: ``repeats`` prompts of ``words`` words, each through the five rounds."""
    prompts = make_prompts(repeats, words=words, seed=31 + words)
    rounds: list[list[str]] = []
    reset_after: list[int] = []
    for prompt in prompts:
        # compute; vLLM hit (beside the background save: not counted); vLLM hit;
        # reset; tier hit; vLLM hit again.
        rounds += [[prompt]] * 3
        reset_after.append(len(rounds) - 1)
        rounds += [[prompt]] * 2
    with tempfile.TemporaryDirectory(prefix="kvc-bench-hybrid-") as tmp:
        engine = EngineSpec(
            model=model,
            rounds=rounds,
            kv_transfer_config=pipeline(),
            max_tokens=1,
            prefix_caching=True,
            reset_after=reset_after,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_gib=KV_CACHE_GIB,
            threads_bind=THREADS,
            env=engine_env(Path(tmp)),
            timeout_s=3000,
        )
        load_before = os.getloadavg()[0]
        result = run_engine(engine)
        load_after = os.getloadavg()[0]
    compute, vllm_hit, tier_hit = [], [], []
    full_bytes = served = 0
    for i in range(repeats):
        first, _, again, tier, again2 = (result.rounds[5 * i + k][0] for k in range(5))
        if not first.tokens == again.tokens == tier.tokens == again2.tokens:
            raise AssertionError(f"{words}-word prompt {i}: a cache changed the output")
        if not tier.cached_tokens:
            raise AssertionError(f"{words}-word prompt {i}: the tier served nothing")
        compute.append(first.ttft_s or float("nan"))
        vllm_hit += [again.ttft_s or float("nan"), again2.ttft_s or float("nan")]
        tier_hit.append(tier.ttft_s or float("nan"))
        # The tier stores whole blocks of the prompt.
        full_bytes += first.prompt_tokens // BLOCK * BLOCK * full_attention_bytes_per_token(spec)
        served = ((tier.kv_transfer_params or {}).get("kv_composer") or {}).get("tokens", 0)
    stored = saved_bytes(result.log)
    return {
        "words": words,
        "tokens": result.rounds[0][0].prompt_tokens,
        "served": served,
        "repeats": repeats,
        "compute": compute,
        "vllm_hit": vllm_hit,
        "tier_hit": tier_hit,
        "stored_bytes": stored / repeats,
        "full_bytes": full_bytes / repeats,
        "load": (load_before, load_after),
        "result": result,
    }


def plain_capacity(model: str) -> EngineResult:
    """A plain engine (no connector) at the same settings: vLLM's own KV capacity."""
    return run_engine(
        EngineSpec(
            model=model,
            rounds=[make_prompts(1, words=50, seed=3)],
            max_tokens=1,
            prefix_caching=True,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_gib=KV_CACHE_GIB,
            threads_bind=THREADS,
            timeout_s=900,
        )
    )


def _ms(xs: list[float]) -> str:
    return " ".join(f"{x * 1000:.0f}" for x in xs)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> int:
    spec = shape()
    full = sum(1 for k in spec.layer_types if k == "full_attention")
    head_dim = spec.head_dim or spec.hidden // spec.heads
    print(
        "== offload-cpu on a sliding-window hybrid model (vLLM's hybrid KV cache manager on) ==\n"
        f"model: random-weight gemma3, {spec.layers} layers ({spec.layers - full} sliding "
        f"window {spec.sliding_window} : {full} full attention), hidden {spec.hidden}, "
        f"{spec.heads} heads / {spec.kv_heads} KV head x {head_dim}, intermediate "
        f"{spec.intermediate}; {full_attention_bytes_per_token(spec)} B of KV per token if "
        f"every layer kept every token\n"
        f"offload-cpu capacity {CAPACITY}, window_retention {retention()}; "
        f"VLLM_CPU_OMP_THREADS_BIND={THREADS}, VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}, "
        f"max_model_len {MAX_MODEL_LEN}, block size {BLOCK}",
        flush=True,
    )
    model = str(build_tiny_model(spec))
    # First: it also leaves vLLM's compiled model in its cache for the engines below.
    plain = plain_capacity(model)
    without = kv_capacity(plain.log)
    print(
        f"\nvLLM KV capacity without a connector: {without} tokens "
        f"(KV cache groups ({group_sizes(plain.log)}))",
        flush=True,
    )
    rows = []
    for words in LENGTHS:
        repeats = REPEATS
        try:
            row = measure_length(model, spec, words, repeats)
        except (EngineFailed, AssertionError) as exc:
            print(f"\n{words}-word prompts: not measured: {str(exc).splitlines()[0]}", flush=True)
            continue
        rows.append(row)
        res: EngineResult = row["result"]
        c, v, t = (statistics.median(row[k]) for k in ("compute", "vllm_hit", "tier_hit"))
        print(
            f"\n{row['tokens']}-token prompts ({repeats}; {row['served']} tokens served by the "
            f"tier), KV cache groups ({group_sizes(res.log)}): "
            f"{log_field(res.log, 'offload-cpu scheduler', 'groups')}; slot "
            f"{log_field(res.log, 'offload-cpu worker pool', 'slot_bytes')} B; "
            f"load average {row['load'][0]:.1f} -> {row['load'][1]:.1f}\n"
            f"  compute         {c * 1000:9.1f} ms   [{_ms(row['compute'])}]\n"
            f"  vLLM cache hit  {v * 1000:9.1f} ms   [{_ms(row['vllm_hit'])}]\n"
            f"  tier hit        {t * 1000:9.1f} ms   [{_ms(row['tier_hit'])}]\n"
            f"  stored per request {_mib(row['stored_bytes'])}, full attention "
            f"{_mib(row['full_bytes'])}",
            flush=True,
        )
        row["medians"] = (c, v, t)
    with_pipeline = [kv_capacity(r["result"].log) for r in rows]
    if not rows:
        print(f"\nvLLM KV capacity without a connector: {without} tokens; nothing else measured")
        return 1 if LENGTHS else 0
    turned_off = any("Turning off hybrid" in r["result"].log for r in rows)

    print(
        "\n| prompt tokens | compute | vLLM hit | tier hit | tier / vLLM hit (<= 1.05) "
        "| stored / full attention |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        c, v, t = row["medians"]
        print(
            f"| {row['tokens']} | {c * 1000:.0f} ms | {v * 1000:.1f} ms | {t * 1000:.1f} ms "
            f"| {t / v:.2f} | {_mib(row['stored_bytes'])} / {_mib(row['full_bytes'])} = "
            f"{row['stored_bytes'] / row['full_bytes']:.2f} |"
        )
    ratios = ", ".join(f"{w / without:.2f}" for w in with_pipeline)
    print(
        f"\nvLLM KV capacity: {without} tokens without a connector, "
        f"{'/'.join(str(w) for w in with_pipeline)} with the pipeline: "
        f"with / without = {ratios} (target 1.00); hybrid manager "
        f"{'TURNED OFF' if turned_off else 'kept on'} with the pipeline "
        f"(groups: {group_sizes(plain.log)} plain)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
