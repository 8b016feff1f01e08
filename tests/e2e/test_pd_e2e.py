"""Disaggregated prefill/decode through one pipeline file: two `kvc serve` engines over
real NIXL, alone and behind vLLM's router (``kvc bench --pd``).

``examples/pd-nixl.yaml`` (an ``offload-cpu`` tier beside a ``plugin: vllm``
NixlConnector transport) runs on a prefill engine as the producer and on a
decode engine as the consumer: ``kvc serve --kv-role``, started once for the
module by ``kvc bench --pd``'s own code (:func:`composer.bench.pd.pd_engines`,
side by side, always stopped), one CPU core each. Every check here uses them.
The producer prefills with ``do_remote_decode`` and one token; the consumer
decodes with the producer's ``kv_transfer_params``, pulling the prompt's KV
over NIXL (UCX, host memory: ``kv_buffer_device: cpu``).

Every token comparison is against a plain engine (no connector) run in this
module, in float32 and with the same number of OpenMP threads (one, on core
1). The P/D engines must run float32 (see ``EngineSpec.dtype``: with bfloat16
the decode engine died with ``Illegal instruction`` in
``cpu_attention_with_kv_cache`` once NIXL was loaded). That the bytes came
over NIXL is proven, not assumed: a producer whose KV cache is overwritten
after its prefill (``composer.testing.kv_probe``, through vLLM's
``/collective_rpc``) changes the consumer's tokens, while the untouched one
gives the plain engine's.

After every check both engines hold no block (vLLM's ``kv_cache_usage_perc``
back to 0): nothing leaked, whatever the check did. The producer is killed by
the last check: keep it last.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer import scrape
from composer.bench.fleet import POLICIES
from composer.bench.pd import PDEngines, pd_engines, run_mode, warm_up
from composer.bench.replay import make_prompts, served_model, vocab_size_of
from composer.bench.report import RunResult
from composer.bench.servers import Config, ServerSpec
from composer.bench.spec import BenchSpec
from composer.testing.engine import EngineResult, EngineSpec, run_engine
from composer.testing.kv_events import Subscriber
from composer.trace import read_trace

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "pd-nixl.yaml"
TRACE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
BLOCK, MAX_LEN, MAX_TOKENS = 32, 2048, 8
#: The producer's NIXL lease (``kv_lease_duration``, vLLM's default 30): how long it
#: holds a prompt's blocks for a decode engine that has not read them. A read after
#: it gets blocks that may have been reused (vLLM logs "Potentially invalid KV
#: blocks"). Short, for the lease check; every other check reads well within it, with
#: ``nixl_poll_ms`` (without it requests here waited out whole leases, and a late read
#: decoded wrong tokens: docs/disaggregated.md).
LEASE_S = 10
#: vLLM's KV cache on the producer, in blocks: one max-length request, and little more.
PRODUCER_BLOCKS = 80
#: Seconds an engine may take to give its blocks back after a check.
RELEASE_S = LEASE_S + 30.0


def _prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    # Ids well inside the tiny model's vocabulary.
    return [rng.randrange(10, 250) for _ in range(n)]


#: Prompts; each check has its own, so no check depends on another's cache.
PLAIN = _prompt(1)
OVERWRITTEN = _prompt(2)
HELD = _prompt(7)
#: Plain requests that, on the producer's small cache, take every block not held.
FILLERS = [_prompt(100 + i, 600) for i in range(5)]
TURN1 = _prompt(3)
TURN2 = TURN1 + _prompt(33, 50)  # the conversation's next turn: TURN1 and a new tail
PREFIX = _prompt(4)
EXTENDED = PREFIX + _prompt(44, 50)
NEVER_READ = _prompt(6)
KILLED = _prompt(5)
WARM = _prompt(9)
ALL = [PLAIN, OVERWRITTEN, HELD, TURN1, TURN2, PREFIX, EXTENDED, KILLED]


@dataclass
class Reply:
    tokens: list[int]
    kv_transfer_params: dict[str, Any] | None


@dataclass
class PD:
    engines: PDEngines
    #: The plain float32 engine's tokens of each prompt in ALL.
    plain: dict[tuple[int, ...], list[int]]
    #: What the decode engine published (vLLM's ZMQ publisher, every event since start).
    events: Subscriber
    spec: ServerSpec
    workdir: Path
    model: str = ""
    vocab: int = 0
    #: (call, prompt tokens, seconds) of the current test, for its figures.
    calls: list[tuple[str, int, float]] = field(default_factory=list)

    def complete(
        self, url: str, ids: list[int], max_tokens: int, params: dict[str, Any] | None
    ) -> Reply:
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": params,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        return Reply(answer["choices"][0]["token_ids"], answer.get("kv_transfer_params"))

    def prefill(self, ids: list[int]) -> Reply:
        t0 = time.monotonic()
        out = self.complete(self.engines.prefill.url, ids, 1, {"do_remote_decode": True})
        self.calls.append(("prefill", len(ids), time.monotonic() - t0))
        return out

    def decode(self, ids: list[int], params: dict[str, Any] | None) -> Reply:
        t0 = time.monotonic()
        out = self.complete(self.engines.decode.url, ids, MAX_TOKENS, params)
        self.calls.append(("decode", len(ids), time.monotonic() - t0))
        return out

    def expected(self, ids: list[int]) -> list[int]:
        return self.plain[tuple(ids)]

    def overwrite_producer_kv(self, value: float) -> int:
        """Every element of the producer's KV cache set to ``value`` (its worker's
        ``KVProbe.overwrite_kv``); the elements written."""
        request = urllib.request.Request(
            f"{self.engines.prefill.url}/collective_rpc",
            data=json.dumps({"method": "overwrite_kv", "args": [str(value)]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return sum(int(r) for r in json.loads(response.read())["results"])


def _served(reply: Reply) -> dict[str, Any]:
    """What KV Composer says served the request (``annotate_outputs``)."""
    return dict((reply.kv_transfer_params or {}).get("kv_composer") or {})


def _samples(url: str) -> list[scrape.Sample]:
    return scrape.fetch(url)


def _usage(url: str) -> float:
    """The share of vLLM's KV cache blocks held by requests (cached, free ones not)."""
    return scrape.total(_samples(url), "vllm:kv_cache_usage_perc")


def _wait_released(url: str, timeout_s: float = RELEASE_S) -> float:
    """Seconds until the engine holds no block; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while (usage := _usage(url)) > 0:
        assert time.monotonic() - t0 < timeout_s, f"{url} still holds {usage:.2%} of its blocks"
        time.sleep(0.25)
    return time.monotonic() - t0


def _test_pipeline(workdir: Path) -> Path:
    """The example pipeline with a small CPU tier (two engines on a test machine), the
    tier's KV events on, a short NIXL lease and ``nixl_poll_ms: 1``: with NIXL's own
    progress thread, which polls without pause, the two engines' threads took both
    cores of the 2-core test machine, and while the producer held a prompt the machine
    stood still until the lease ended (a decode then read reused blocks: wrong tokens).
    See docs/disaggregated.md for what was measured either way."""
    data = yaml.safe_load(PIPELINE.read_text())
    data["nodes"]["cpu"]["config"].update(capacity="64MiB", events=True)
    nixl = data["nodes"]["nixl"]["config"]
    nixl["nixl_poll_ms"] = 1
    nixl.setdefault("extra_config", {})["kv_lease_duration"] = LEASE_S
    path = workdir / "pd.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def pd(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    t0 = time.monotonic()
    workdir = tmp_path_factory.mktemp("pd")
    spec = ServerSpec(
        model=tiny_model,
        block_size=BLOCK,  # CPU attention needs a multiple of 32
        max_model_len=MAX_LEN,
        extra_args=[
            "--enforce-eager",
            "--worker-extension-cls",
            "composer.testing.kv_probe.KVProbe",
        ],
        env={"KV_COMPOSER_PLUGIN_MODULES": ""},
    )
    # The plain engine runs beside the P/D engines' start (a start is mostly
    # imports and waiting; the token comparisons do not depend on speed).
    plain_run: list[EngineResult] = []
    plain_spec = EngineSpec(
        model=tiny_model,
        rounds=[[{"prompt_token_ids": p} for p in ALL]],
        threads_bind="1",  # one OpenMP thread, as each P/D engine has
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        enforce_eager=True,
        dtype="float32",
        env={"KV_COMPOSER_PLUGIN_MODULES": ""},
    )
    plain_thread = threading.Thread(target=lambda: plain_run.append(run_engine(plain_spec)))
    plain_thread.start()
    events = Subscriber()
    publisher = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events.endpoint,
        "topic": "",
    }
    try:
        config = Config.parse(str(_test_pipeline(workdir)))
        own_args = (
            ("--num-gpu-blocks-override", str(PRODUCER_BLOCKS)),
            ("--kv-events-config", json.dumps(publisher)),
        )
        with pd_engines(config, spec, workdir, own_args) as engines:
            plain_thread.join()
            assert plain_run, "the plain engine did not run"
            plain = {
                tuple(p): r.tokens for p, r in zip(ALL, plain_run[0].rounds[0], strict=True)
            }
            print(f"P/D engines up {time.monotonic() - t0:.1f} s after the module started")
            pd = PD(engines, plain, events, spec, workdir)
            pd.model = served_model(engines.prefill.url)
            # Warm: the decode engine's first pull pays for NIXL's handshake; then both
            # engines hold no block, as every check ends.
            pd.decode(WARM, pd.prefill(WARM).kv_transfer_params)
            _wait_both_released(engines)
            pd.calls.clear()
            pd.vocab = vocab_size_of(tiny_model) or 0
            yield pd
    finally:
        plain_thread.join()
        events.stop()


@pytest.fixture(autouse=True)
def _no_leaked_blocks(pd: PD, figures: Callable[[str], None]) -> Iterator[None]:
    """After every check, each live engine gives back every block it held; each
    request's wall time under "figures measured" (a decode includes its transfer)."""
    pd.calls.clear()
    yield
    figures(", ".join(f"{what} {n} tokens {s:.2f} s" for what, n, s in pd.calls))
    _wait_both_released(pd.engines)


def _wait_both_released(engines: PDEngines) -> None:
    """Each live engine holds no block (fails after :data:`RELEASE_S`)."""
    for engine in (engines.prefill, engines.decode):
        if engine.proc.poll() is None:
            _wait_released(engine.url)


def test_the_decode_engine_gets_the_prompt_over_nixl(pd: PD) -> None:
    prefill = pd.prefill(PLAIN)
    decode = pd.decode(PLAIN, prefill.kv_transfer_params)

    # The transport's kv_transfer_params reach the caller (what the router forwards).
    params = prefill.kv_transfer_params or {}
    assert params["do_remote_prefill"] is True and params["remote_engine_id"]
    assert params["remote_num_tokens"] == len(PLAIN)
    assert (params["remote_host"], params["remote_port"]) != (None, None)
    assert prefill.tokens == pd.expected(PLAIN)[:1]
    # The decode engine loaded the whole prompt through the nixl node and
    # generated the plain engine's tokens.
    assert _served(decode) == {"served_by": "nixl", "tokens": len(PLAIN)}
    assert decode.tokens == pd.expected(PLAIN)


def test_the_producer_holds_the_prompt_for_the_decode_side_after_its_tier_saved_it(
    pd: PD,
) -> None:
    """The tier's (sync) save is done when the prefill returns, and the blocks vLLM
    holds for the decode side stay held: plain requests that take every other block
    of the producer's cache, several times over, leave them as they were."""
    saved = f"{scrape.PREFIX}tokens_saved_total"
    before = scrape.total(_samples(pd.engines.prefill.url), saved, node="cpu")
    prefill = pd.prefill(HELD)
    after = scrape.total(_samples(pd.engines.prefill.url), saved, node="cpu")
    assert after - before == len(HELD) // BLOCK * BLOCK
    taken, t0 = 0, time.monotonic()
    for filler in FILLERS:
        pd.complete(pd.engines.prefill.url, filler, 1, None)
        taken += -(-len(filler) // BLOCK)
    pd.calls.append(("fillers", taken * BLOCK, time.monotonic() - t0))
    assert taken > PRODUCER_BLOCKS  # released blocks would have been written over
    decode = pd.decode(HELD, prefill.kv_transfer_params)
    assert _served(decode) == {"served_by": "nixl", "tokens": len(HELD)}
    assert decode.tokens == pd.expected(HELD)


def test_an_overwritten_producer_cache_changes_the_decoded_tokens(pd: PD) -> None:
    """The bytes the decode engine gets are the producer's: zeros written into its
    KV cache after the prefill change the decoded tokens."""
    prefill = pd.prefill(OVERWRITTEN)
    assert pd.overwrite_producer_kv(0.0) > 0
    decode = pd.decode(OVERWRITTEN, prefill.kv_transfer_params)
    assert _served(decode) == {"served_by": "nixl", "tokens": len(OVERWRITTEN)}
    assert decode.tokens != pd.expected(OVERWRITTEN)


def test_the_decode_sides_tier_keeps_what_nixl_delivered(pd: PD) -> None:
    """The conversation's next turn hits the decode engine's CPU tier, with no new
    prefill; the tier's events and stats name it."""
    first = pd.decode(TURN1, pd.prefill(TURN1).kv_transfer_params)
    assert _served(first)["served_by"] == "nixl"
    assert first.tokens == pd.expected(TURN1)
    # vLLM's own prefix cache emptied (as under memory pressure; it would
    # serve the turn first) and no kv_transfer_params: nothing from the prefill
    # engine; the tier serves every full block of the first turn that NIXL delivered.
    _reset_vllm_prefix_cache(pd.engines.decode.url)
    second = pd.decode(TURN2, None)
    full_blocks = len(TURN1) // BLOCK * BLOCK
    assert _served(second) == {"served_by": "cpu", "tokens": full_blocks}
    assert second.tokens == pd.expected(TURN2)
    # vLLM's metrics on the decode engine name each node: what the tier loaded,
    # what NIXL's node was asked for and answered.
    samples = _samples(pd.engines.decode.url)
    assert scrape.total(samples, f"{scrape.PREFIX}tokens_loaded_total", node="cpu") >= full_blocks
    assert scrape.total(samples, f"{scrape.PREFIX}tokens_hit_total", node="nixl") >= len(TURN1)
    # vLLM's event publisher carried the tier's stores of what NIXL delivered,
    # named for the node (the router counts them as the engine's, medium CPU).
    wanted = [tuple(TURN1[i : i + BLOCK]) for i in range(0, full_blocks, BLOCK)]
    stored = _tier_stores(pd.events.wait_for(lambda e: _missing(wanted, _tier_stores(e)) == []))
    assert {e.ownership for e in stored} == {"cpu"}
    missing = _missing(wanted, stored)
    assert missing == [], f"first-turn blocks with no BlockStored: {missing} of {len(wanted)}"


def _tier_stores(events: list[Any]) -> list[Any]:
    """The ``BlockStored`` events of the CPU tier (medium CPU)."""
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]


def _missing(blocks: list[tuple[int, ...]], stored: list[Any]) -> list[int]:
    """The indices of ``blocks`` whose tokens no stored event carries (one block each)."""
    carried = {tuple(e.token_ids) for e in stored}
    return [i for i, block in enumerate(blocks) if block not in carried]


def _reset_vllm_prefix_cache(url: str) -> None:
    """vLLM's own prefix cache emptied, the tiers kept (dev mode's endpoint)."""
    request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_the_prefill_sides_tier_serves_the_prefix_and_nixl_ships_the_whole_prompt(
    pd: PD,
) -> None:
    pd.decode(PREFIX, pd.prefill(PREFIX).kv_transfer_params)
    # vLLM's own prefix cache emptied (it would serve the prefix first).
    _reset_vllm_prefix_cache(pd.engines.prefill.url)
    prefill = pd.prefill(EXTENDED)
    # The producer computed only the tail: its tier served the prefix it saved...
    assert _served(prefill) == {"served_by": "cpu", "tokens": len(PREFIX) // BLOCK * BLOCK}
    # ...and NIXL still ships every token of the prompt.
    assert (prefill.kv_transfer_params or {})["remote_num_tokens"] == len(EXTENDED)
    decode = pd.decode(EXTENDED, prefill.kv_transfer_params)
    # The decode engine's own prefix cache still holds the prefix (from the first
    # decode): it pulls only the rest over NIXL.
    held = len(PREFIX) // BLOCK * BLOCK
    assert _served(decode) == {"served_by": "nixl", "tokens": len(EXTENDED) - held}
    assert decode.tokens == pd.expected(EXTENDED)


def test_a_prompt_no_decode_engine_reads_is_released_when_its_lease_ends(
    pd: PD, figures: Callable[[str], None]
) -> None:
    """The decode side never comes (the router lost it; the transfer timed out):
    the producer holds the prompt's blocks for NIXL's lease, then gives them back,
    the tier's copy kept."""
    pd.prefill(NEVER_READ)
    waited = _wait_released(pd.engines.prefill.url)
    figures(f"released {waited:.1f} s after the prefill (lease {LEASE_S} s)")
    assert waited >= LEASE_S / 2, "released long before the lease ended"
    # The prompt is still servable on the prefill side: its tier kept it (vLLM's own
    # prefix cache emptied: it would serve it first).
    _reset_vllm_prefix_cache(pd.engines.prefill.url)
    again = pd.prefill(NEVER_READ)
    assert _served(again) == {"served_by": "cpu", "tokens": len(NEVER_READ) // BLOCK * BLOCK}
    pd.decode(NEVER_READ, again.kv_transfer_params)


def test_kvc_bench_pd_replays_a_trace_slice_with_and_without_disaggregation(
    pd: PD, figures: Callable[[str], None]
) -> None:
    """``kvc bench --pd``'s run on these engines: a slice of the Mooncake trace through
    vLLM's router in its P/D mode, then through the router over the same engines as
    peers; every request answered, the decode engine fed over NIXL in P/D only."""
    trace = read_trace(TRACE, limit=40)
    prompts, _ = make_prompts(
        trace, scale=16, vocab_size=pd.vocab, max_output_tokens=4, max_model_len=MAX_LEN
    )
    prompts = prompts[:8]
    assert len(prompts) == 8
    spec = BenchSpec(trace=trace, configs=[], server=pd.spec, concurrency=1, workdir=pd.workdir)
    warm_up(pd.engines, prompts[0], pd.workdir / "router-warm-up.log")
    plain_policy = POLICIES["cache_aware"]
    disaggregated = run_mode(spec, pd.engines, "pd", plain_policy, prompts, pd.workdir / "r1.log")
    peers = run_mode(spec, pd.engines, "plain", plain_policy, prompts, pd.workdir / "r2.log")
    for result in (disaggregated, peers):
        figures(_figure(result))
        assert len(result.records) == len(prompts) and result.errors == 0
    # P/D: every request prefilled on one engine and decoded on the other, the
    # decode engine's prompts loaded over NIXL.
    assert disaggregated.engine_requests == [len(prompts), len(prompts)]
    over_nixl = disaggregated.side_tokens["decode:nixl"]
    assert 0 < over_nixl <= sum(len(p.token_ids) for p in prompts)
    # The bytes NIXL moved are the whole blocks of what the nixl node served: at
    # least its tokens' blocks, at most one partial block more per request.
    per_block = BLOCK * _float32_bytes_per_token(pd.spec.model)
    least = -(-over_nixl // BLOCK)
    assert least * per_block <= disaggregated.nixl_bytes <= (least + len(prompts)) * per_block
    # Without P/D: the same engines as peers, nothing over NIXL.
    assert sum(peers.engine_requests) == len(prompts)
    assert peers.nixl_bytes == 0 and not any(peers.side_tokens.get(k) for k in ("engine-1:nixl",))


def _float32_bytes_per_token(model: str) -> int:
    """K and V of every layer, in float32 (the model's config.json)."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def _figure(result: RunResult) -> str:
    s = result.summary()
    p50 = s["ttft_s"]["p50"]
    return (
        f"{result.config}: TTFT p50 {1000 * (p50 or 0):.0f} ms, by engine "
        f"{result.engine_requests}, served {result.side_tokens}, "
        f"NIXL {result.nixl_bytes / 2**20:.1f} MiB"
    )


def test_a_killed_producer_leaves_the_decode_engine_recomputing(pd: PD) -> None:
    """Under kv_load_failure_policy: recompute (the nixl node's on_error), a transfer
    from a producer that died after its prefill fails fast; the consumer computes
    the prompt itself, with the plain engine's tokens, and holds no block after.
    (Kills the producer: the module's last check.)"""
    params = pd.prefill(KILLED).kv_transfer_params
    pd.engines.prefill.kill()
    t0 = time.monotonic()
    decode = pd.decode(KILLED, params)
    assert time.monotonic() - t0 < 60, "the consumer waited on a dead producer"
    assert _served(decode) == {
        "served_by": None,
        "tokens": 0,
        "failed": {"node": "nixl", "tokens": len(KILLED)},
    }
    assert decode.tokens == pd.expected(KILLED)

