"""Time from engine ready to the first offload-cpu tier hit, per pool capacity; engine start time.

One engine per capacity (1, 4, 12 GiB; ``KVC_BENCH_CAPACITIES`` overrides), and
one without the tier. Right after the engine is ready, one prompt is sent, then
sent again as soon as it returned, until a repeat is served by the tier
(``num_cached_tokens`` > 0 with vLLM's prefix cache off). Target: the first
repeat (request 2) hits, whatever the capacity. Before the pool was mapped on a
thread of its own, saves waited behind the mapping of the whole pool (~6 s for
4 GiB), and every repeat meanwhile missed.

Engine start time (``LLM(...)`` until it returns) is printed with and without
the tier, as a ratio. The engine log's ``offload-cpu pool prefaulted`` line
says when the background mapping of the pool finished, for comparison.

Each capacity's pool is host memory: the 12 GiB run maps 12 GiB.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
THREADS = os.environ.get("KVC_BENCH_THREADS", "0-1")
CAPACITIES = os.environ.get("KVC_BENCH_CAPACITIES", "1GiB,4GiB,12GiB").split(",")
#: Give up on a hit after this many seconds of repeats (the old behaviour: ~6 s per 4 GiB).
MAX_WAIT_S = float(os.environ.get("KVC_BENCH_FIRST_HIT_MAX_S", "120"))
MAX_TOKENS = 8
WORDS = 300


def _spec(model: str, prompt: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "kv_transfer_config": kv,
        "max_tokens": MAX_TOKENS,
        "max_wait_s": MAX_WAIT_S,
    }


def run_child(spec: dict[str, Any], timeout_s: float = 900) -> dict[str, Any]:
    """One engine in its own process group (always stopped), as in ``composer.testing.engine``."""
    from composer.servers import spawn
    from composer.testing.engine import EngineFailed, stop_engine

    with tempfile.TemporaryDirectory(prefix="kvc-first-hit-") as tmp:
        spec_file, out_file, log_file = (Path(tmp) / n for n in ("s.json", "r.json", "e.log"))
        spec_file.write_text(json.dumps(spec))
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": THREADS,
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
        proc = spawn(
            [sys.executable, "-m", "benchmarks.first_hit", str(spec_file), str(out_file)],
            log_file,
            env=env,
            cwd=ROOT,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_engine(proc)
        text = log_file.read_text(errors="replace")
        if proc.returncode != 0 or not out_file.exists():
            raise EngineFailed(f"engine exited with {proc.returncode}:\n{text[-4000:]}")
        result: dict[str, Any] = json.loads(out_file.read_text())
        mapped = re.findall(r"offload-cpu pool prefaulted.*?seconds=([0-9.]+)", text)
        result["prefault_s"] = float(mapped[0]) if mapped else None
        part = re.findall(r"offload-cpu pool prefault stopped.*?mapped_gib=([0-9.]+)", text)
        result["mapped_gib_at_exit"] = float(part[0]) if part else None
        return result


def _child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        block_size=32,
        max_model_len=2048,
        enable_prefix_caching=False,
        kv_transfer_config=spec["kv_transfer_config"],
        seed=0,
    )
    ready = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    requests: list[dict[str, Any]] = []
    while True:
        out = llm.generate([spec["prompt"]], params, use_tqdm=False)[0]
        requests.append({
            "done_s": time.perf_counter() - ready,
            "cached": out.num_cached_tokens or 0,
            "prompt_tokens": len(out.prompt_token_ids or ()),
            "tokens": list(out.outputs[0].token_ids),
        })
        if len(requests) > 1 and (
            requests[-1]["cached"] > 0 or requests[-1]["done_s"] > spec["max_wait_s"]
        ):
            break
        if spec["kv_transfer_config"] is None and len(requests) > 1:  # nothing to wait for
            break
    Path(out_path).write_text(json.dumps({"startup_s": ready - t0, "requests": requests}))
    llm.llm_engine.engine_core.shutdown(timeout=60)


def main() -> None:
    from composer import kv_transfer_config, load_pipeline
    from composer.testing.tiny_model import build_tiny_model, make_prompts

    model = str(build_tiny_model())
    prompt = make_prompts(1, words=WORDS, seed=41)[0]
    print(
        "== time from engine ready to the first offload-cpu tier hit; engine start time ==\n"
        f"one {WORDS}-word prompt, sent again as soon as it returned ({MAX_TOKENS} tokens each), "
        f"VLLM_CPU_OMP_THREADS_BIND={THREADS}, prefix cache off"
    )
    plain = run_child(_spec(model, prompt, None))
    base = plain["startup_s"]
    print(f"\n  {'pipeline':<24}{'start':>9}{'vs none':>9}{'first hit':>11}"
          f"{'ready->hit':>12}{'pool mapped':>13}")
    print(f"  {'none':<24}{base:8.1f}s{1.0:8.2f}x{'-':>11}{'-':>12}{'-':>13}")
    for cap in CAPACITIES:
        pipeline = {"version": 1, "nodes": {"cpu": {
            "plugin": "offload-cpu", "config": {"capacity": cap}}}}
        r = run_child(_spec(model, prompt, kv_transfer_config(load_pipeline(pipeline))))
        reqs = r["requests"]
        hit = next((i for i, q in enumerate(reqs) if q["cached"] > 0), None)
        same = all(q["tokens"] == plain["requests"][0]["tokens"] for q in reqs)
        first = f"request {hit + 1}" if hit is not None else "none"
        when = f"{reqs[hit]['done_s']:.2f}s" if hit is not None else f">{reqs[-1]['done_s']:.0f}s"
        mapped = f"{r['prefault_s']:.1f}s" if r["prefault_s"] is not None else "not yet"
        if r["mapped_gib_at_exit"] is not None:
            mapped = f"{r['mapped_gib_at_exit']:.1f}GiB@exit"
        print(
            f"  {'offload-cpu ' + cap:<24}{r['startup_s']:8.1f}s{r['startup_s'] / base:8.2f}x"
            f"{first:>11}{when:>12}{mapped:>13}"
            + ("" if same else "   TOKENS DIFFER from the run without the tier")
        )
    print(
        f"  ({plain['requests'][0]['prompt_tokens']}-token prompt; target: the first hit is "
        "request 2, the first repeat, whatever the capacity; 'pool mapped': background "
        "mapping of the whole pool, in the engine log)"
    )


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
    os._exit(0)
