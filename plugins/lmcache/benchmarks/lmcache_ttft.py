"""Time to first token of a long prompt served by the LMCache tier, as ratios.

Two engine processes with the same VLLM_CPU_OMP_THREADS_BIND, on a
random-weight model shaped like Qwen2-0.5B (24 layers, ~12 KiB of KV per
token) and one ~2000-token prompt:

* ``vllm``: no connector, vLLM's prefix cache on: the prompt once cold
  (recompute) and once again (vLLM's own cache hit);
* ``lmcache``: the pipeline model-tracker + offload-cpu (too small to hold
  the prompt, so it is evicted there) + lmcache (a started `lmcache server`),
  vLLM's prefix cache off: the prompt once cold and once again (served by
  LMCache).

Each engine first runs a short unrelated prompt, so no timing includes warm-up.
Prints the TTFTs and the ratios recompute / LMCache and LMCache / vLLM hit.
``python plugins/lmcache/benchmarks/lmcache_ttft.py`` (a few minutes).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from composer import kv_transfer_config, load_pipeline
from composer.testing.engine import EngineResult, EngineSpec, run_engine
from composer.testing.tiny_model import QWEN_05B_SHAPE, build_tiny_model, make_prompts

CHUNK = 256


def pipeline() -> dict[str, Any]:
    return kv_transfer_config(
        load_pipeline(
            {
                "version": 1,
                "annotate_outputs": True,
                "nodes": {
                    "tracker": {"plugin": "model-tracker"},
                    # One block of this model is 384 KiB: the tier holds 2, the prompt needs ~60.
                    "cpu": {"plugin": "offload-cpu", "config": {"capacity": "768KiB"}},
                    "lmcache": {
                        "plugin": "lmcache",
                        "needs": ["tracker"],
                        "config": {"chunk_size": CHUNK, "server": {"l1_size_gb": 1}},
                    },
                },
                "load_order": ["cpu", "lmcache"],
                # The tier may keep 1-2 of the prompt's blocks: the longest hit
                # (LMCache's) must serve, not a 2-block CPU hit.
                "load_policy": "longest_hit",
            }
        )
    )


def run(words: int = 1900, threads_bind: str = "0-1") -> dict[str, Any]:
    model = str(build_tiny_model(QWEN_05B_SHAPE))
    warm = make_prompts(1, words=40, seed=90)
    (prompt,) = make_prompts(1, words=words, seed=91)
    rounds = [warm, [prompt], [prompt]]

    def spec(**kw: Any) -> EngineSpec:
        return EngineSpec(
            model=model,
            rounds=rounds,
            max_tokens=1,
            max_model_len=4096,
            kv_cache_gib=2,
            threads_bind=threads_bind,
            timeout_s=560,
            **kw,
        )

    vllm = run_engine(spec(prefix_caching=True, reset_between_rounds=False))
    lmc = run_engine(spec(kv_transfer_config=pipeline()))
    return _report(vllm, lmc)


def _ttft(result: EngineResult, r: int) -> float:
    value = result.rounds[r][0].ttft_s
    assert value is not None, "vLLM reported no first-token latency"
    return value


def _report(vllm: EngineResult, lmc: EngineResult) -> dict[str, Any]:
    hit = lmc.rounds[2][0]
    served = (hit.kv_transfer_params or {}).get("kv_composer", {}).get("served_by")
    out = {
        "prompt_tokens": hit.prompt_tokens,
        "recompute_s": _ttft(vllm, 1),
        "vllm_hit_s": _ttft(vllm, 2),
        "vllm_hit_cached_tokens": vllm.rounds[2][0].cached_tokens,
        "recompute_with_pipeline_s": _ttft(lmc, 1),
        "lmcache_hit_s": _ttft(lmc, 2),
        "lmcache_cached_tokens": hit.cached_tokens,
        "served_by": served,
        "same_tokens": lmc.tokens(2) == vllm.tokens(2),
    }
    # The cold run in the same engine (same threads, same moment) is the fair
    # recompute reference on a shared machine; the plain engine's is shown too.
    out["recompute_over_lmcache"] = out["recompute_with_pipeline_s"] / out["lmcache_hit_s"]
    out["plain_recompute_over_lmcache"] = out["recompute_s"] / out["lmcache_hit_s"]
    out["lmcache_over_vllm_hit"] = out["lmcache_hit_s"] / out["vllm_hit_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    words = int(args[0]) if args else 1900
    r = run(words)
    print(json.dumps(r, indent=2))
    print(
        f"{r['prompt_tokens']}-token prompt, TTFT: recompute {r['recompute_s'] * 1e3:.0f} ms, "
        f"vLLM cache hit {r['vllm_hit_s'] * 1e3:.0f} ms, "
        f"LMCache tier {r['lmcache_hit_s'] * 1e3:.0f} ms "
        f"({r['lmcache_cached_tokens']} tokens, served by {r['served_by']}); recompute in the "
        f"pipeline engine {r['recompute_with_pipeline_s'] * 1e3:.0f} ms: "
        f"{r['recompute_over_lmcache']:.1f}x faster than recompute, "
        f"{r['lmcache_over_vllm_hit']:.1f}x vLLM's own hit"
    )
    return 0 if r["served_by"] == "lmcache" else 1


if __name__ == "__main__":
    raise SystemExit(main())
