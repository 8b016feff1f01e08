"""Disaggregated prefill/decode through one pipeline file, in real vLLM engines over real NIXL.

``examples/pd-nixl.yaml`` (an ``offload-cpu`` tier beside a ``plugin: vllm``
NixlConnector transport) runs on a prefill engine as the producer and on a
decode engine as the consumer, both alive for the whole module (started once,
side by side; every check here uses them; always stopped). The producer
prefills with ``do_remote_decode`` and one token; the consumer decodes with
the producer's ``kv_transfer_params``, pulling the prompt's KV over NIXL
(UCX, host memory: ``kv_buffer_device: cpu``).

Every token comparison is against a plain engine (no connector) run in this
module, in float32 and with the same number of OpenMP threads (one each: the
producer on core 0, the consumer and the plain engine on core 1, so that the
two P/D engines do not contend for cores). Not the plain_llama fixture: it
runs bfloat16, and the P/D engines must run float32 (see ``EngineSpec.dtype``:
with bfloat16 the decode engine died with ``Illegal instruction`` in
``cpu_attention_with_kv_cache`` once NIXL was loaded). That the bytes came
over NIXL is proven, not assumed: a producer whose KV cache is overwritten
after its prefill changes the consumer's tokens, while the untouched one gives
the plain engine's.

The producer is killed by the last test (a failed transfer): keep it last.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer import scrape
from composer.export import kv_transfer_config
from composer.servers.loopback import LOOPBACK, free_port
from composer.testing.engine import EngineSpec, RequestResult, run_engine
from composer.testing.engine_session import EngineSession
from composer.validation import load_pipeline

pytestmark = pytest.mark.e2e

PIPELINE = Path(__file__).resolve().parents[2] / "examples" / "pd-nixl.yaml"
BLOCK = 32
MAX_TOKENS = 8


def _prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    # Ids well inside the tiny model's vocabulary.
    return [rng.randrange(10, 250) for _ in range(n)]


#: Prompts; each check has its own, so no check depends on another's cache.
PLAIN = _prompt(1)
OVERWRITTEN = _prompt(2)
TURN1 = _prompt(3)
TURN2 = TURN1 + _prompt(33, 50)  # the conversation's next turn: TURN1 and a new tail
PREFIX = _prompt(4)
EXTENDED = PREFIX + _prompt(44, 50)
KILLED = _prompt(5)
ALL = [PLAIN, OVERWRITTEN, TURN1, TURN2, PREFIX, EXTENDED, KILLED]


def _tokens(ids: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if params is not None:
        prompt["kv_transfer_params"] = params
    return prompt


@dataclass
class PD:
    producer: EngineSession
    consumer: EngineSession
    #: The plain float32 engine's tokens of each prompt in ALL.
    plain: dict[tuple[int, ...], list[int]]

    #: (call, prompt tokens, seconds) of the current test, for its figures.
    calls: list[tuple[str, int, float]] = field(default_factory=list)

    def prefill(self, ids: list[int]) -> RequestResult:
        t0 = time.monotonic()
        (out,) = self.producer.generate([_tokens(ids, {"do_remote_decode": True})], max_tokens=1)
        self.calls.append(("prefill", len(ids), time.monotonic() - t0))
        return out

    def decode(self, ids: list[int], params: dict[str, Any] | None) -> RequestResult:
        t0 = time.monotonic()
        (out,) = self.consumer.generate([_tokens(ids, params)], timeout_s=120)
        self.calls.append(("decode", len(ids), time.monotonic() - t0))
        return out

    def expected(self, ids: list[int]) -> list[int]:
        return self.plain[tuple(ids)]


def _served(result: RequestResult) -> dict[str, Any]:
    """What KV Composer says served the request (``annotate_outputs``)."""
    return dict((result.kv_transfer_params or {}).get("kv_composer") or {})


def _spec(
    model: str, core: str, config: dict[str, Any] | None = None, **env: str
) -> EngineSpec:
    return EngineSpec(
        model=model,
        rounds=[],
        kv_transfer_config=config,
        # One OpenMP thread on every engine compared (a different count can flip
        # a near-tie in a tiny random model's greedy tokens).
        threads_bind=core,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,  # CPU attention needs a multiple of 32
        enforce_eager=True,
        in_process=True,
        # NIXL loaded: float32 (bfloat16 died with Illegal instruction; see EngineSpec.dtype).
        dtype="float32",
        env={"KV_COMPOSER_PLUGIN_MODULES": "", **env},
    )


def _side_config(side: str) -> dict[str, Any]:
    """The example pipeline's kv_transfer_config for one side, as `kvc export --kv-role`,
    its CPU tier made small (two engines on a test machine)."""
    data = yaml.safe_load(PIPELINE.read_text())
    data["nodes"]["cpu"]["config"]["capacity"] = "64MiB"
    config = kv_transfer_config(load_pipeline(data, kv_role=side))
    # A transfer that fails leaves the decode engine recomputing (vLLM's default: fail).
    config["kv_load_failure_policy"] = "recompute"
    return config


@pytest.fixture(scope="module")
def pd(tiny_model: str) -> Iterator[PD]:
    t0 = time.monotonic()
    sessions = []
    for side, core in (("producer", "0"), ("consumer", "1")):
        # Each engine its own NIXL side channel, on loopback.
        channel = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        spec = _spec(tiny_model, core, _side_config(side), **channel)
        sessions.append(EngineSession(spec, side))
    producer, consumer = sessions
    try:
        # The three engines start side by side: a start is mostly imports and
        # waiting, and the token comparisons do not depend on speed.
        producer.launch()
        consumer.launch()
        plain_run = run_engine(replace(_spec(tiny_model, "1"), rounds=[[_tokens(p) for p in ALL]]))
        plain = {tuple(p): r.tokens for p, r in zip(ALL, plain_run.rounds[0], strict=True)}
        producer.wait_ready()
        consumer.wait_ready()
        print(f"P/D engines up {time.monotonic() - t0:.1f} s after the module started")
        yield PD(producer, consumer, plain)
    finally:
        producer.close()
        consumer.close()


@pytest.fixture(autouse=True)
def _call_times(pd: PD, figures: Any) -> Iterator[None]:
    """Each request's wall time, under "figures measured" (a decode includes its transfer)."""
    pd.calls.clear()
    yield
    figures(", ".join(f"{what} {n} tokens {s:.2f} s" for what, n, s in pd.calls))


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


def test_an_overwritten_producer_cache_changes_the_decoded_tokens(pd: PD) -> None:
    """The bytes came over NIXL: zeros in the producer's KV cache after its
    prefill reach the consumer and change what it generates."""
    prefill = pd.prefill(OVERWRITTEN)
    assert pd.producer.overwrite_kv(0.0) > 0
    decode = pd.decode(OVERWRITTEN, prefill.kv_transfer_params)
    assert _served(decode) == {"served_by": "nixl", "tokens": len(OVERWRITTEN)}
    assert decode.tokens != pd.expected(OVERWRITTEN)


def test_the_decode_sides_tier_keeps_what_nixl_delivered(pd: PD) -> None:
    """The conversation's next turn hits the decode engine's CPU tier, with no new prefill."""
    first = pd.decode(TURN1, pd.prefill(TURN1).kv_transfer_params)
    assert _served(first)["served_by"] == "nixl"
    assert first.tokens == pd.expected(TURN1)
    # No kv_transfer_params: nothing from the prefill engine; the tier serves
    # every full block of the first turn that NIXL delivered.
    second = pd.decode(TURN2, None)
    full_blocks = len(TURN1) // BLOCK * BLOCK
    assert _served(second) == {"served_by": "cpu", "tokens": full_blocks}
    assert second.tokens == pd.expected(TURN2)
    # vLLM's metrics on the decode engine name each node: what the tier loaded,
    # what NIXL's node was asked for and answered.
    samples = scrape.parse(pd.consumer.metrics())
    assert scrape.total(samples, f"{scrape.PREFIX}tokens_loaded_total", node="cpu") >= full_blocks
    assert scrape.total(samples, f"{scrape.PREFIX}tokens_hit_total", node="nixl") >= len(TURN1)


def test_the_prefill_sides_tier_serves_the_prefix_and_nixl_ships_the_whole_prompt(
    pd: PD,
) -> None:
    pd.decode(PREFIX, pd.prefill(PREFIX).kv_transfer_params)
    prefill = pd.prefill(EXTENDED)
    # The producer computed only the tail: its tier served the prefix it saved...
    assert _served(prefill) == {"served_by": "cpu", "tokens": len(PREFIX) // BLOCK * BLOCK}
    # ...and NIXL still ships every token of the prompt.
    assert (prefill.kv_transfer_params or {})["remote_num_tokens"] == len(EXTENDED)
    decode = pd.decode(EXTENDED, prefill.kv_transfer_params)
    assert _served(decode) == {"served_by": "nixl", "tokens": len(EXTENDED)}
    assert decode.tokens == pd.expected(EXTENDED)


def test_a_killed_producer_leaves_the_decode_engine_recomputing(pd: PD) -> None:
    """Under kv_load_failure_policy: recompute, a transfer from a producer that
    died after its prefill fails fast; the consumer computes the prompt itself,
    with the plain engine's tokens. (Kills the producer: the module's last check.)"""
    params = pd.prefill(KILLED).kv_transfer_params
    pd.producer.kill()
    t0 = time.monotonic()
    decode = pd.decode(KILLED, params)
    assert time.monotonic() - t0 < 60, "the consumer waited on a dead producer"
    assert _served(decode) == {
        "served_by": None,
        "tokens": 0,
        "failed": {"node": "nixl", "tokens": len(KILLED)},
    }
    assert decode.tokens == pd.expected(KILLED)
