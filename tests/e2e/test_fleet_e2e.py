"""A fleet of two `kvc serve` engines behind vLLM's router (vllm-router), real processes.

Both engines run ``examples/fleet-cpu-events.yaml`` (an offload-cpu tier that
publishes its KV events through vLLM's ZMQ publisher), one CPU core each (every
process of an engine on it, checked),
started once for the module; every run empties their caches first.

* **The tier's events steer the router.** Each engine is given a prompt of its
  own (sent to it directly), then enough other prompts that vLLM's own cache
  no longer holds it: only the engine's CPU tier does. Through the router,
  each prompt's next turn goes to the engine whose tier holds it and is served
  by that tier under ``kv_aware-tiers``; under ``kv_aware-vllm`` (the router
  credits vLLM's own events only) the router sees no cached block anywhere and
  both turns go to one engine, so one of them is computed again.
* **A trace slice through every policy** (the Mooncake conversations that come
  back, one request at a time): every request answered, the prompt tokens
  served (vLLM's prefix cache and the tier, both engines) as
  ``kvc simulate --fleet --concurrency 1`` predicts them, within 1 percentage
  point, and the requests each engine got within 10 % of the slice.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from composer import load_pipeline
from composer.bench.fleet import (
    POLICIES,
    SETTLE_S,
    Engine,
    counters,
    empty,
    event_sources,
    fleet,
    run_policy,
    warm_up,
)
from composer.bench.replay import Prompt, make_prompts, send, served_model, vocab_size_of
from composer.bench.servers import Config, ServerSpec
from composer.bench.spec import BenchSpec
from composer.servers.vllm_router import vllm_router
from composer.simulate.fleet import simulate_fleet
from composer.simulate.shape import model_shape
from composer.trace import multi_turn, read_trace

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
TRACE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
BLOCK, MAX_LEN, VLLM_BLOCKS, OUTPUT = 32, 2048, 80, 4
#: Seconds between two requests of the slice (measured without: the router's load
#: count lags a request's end, so its least-loaded fallback now and then picks the
#: other engine, 2 of 110 requests in one run of kv_aware-vllm, 3.4 pp).
PAUSE_S = 0.02
#: The slice: the conversations that come back among the trace's first this many
#: requests: 59 that fit (the whole 500-request file gives 110, at twice the time).
SLICE_FROM = 350
#: A prompt of 24 blocks, and the filler that pushes it out of vLLM's 80-block cache.
PROMPT_BLOCKS, FILLERS = 24, 5


def _ids(seed: int, blocks: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(blocks * BLOCK)]


def _prompt(index: int, ids: list[int]) -> Prompt:
    return Prompt(index, ids, OUTPUT, 0.0)


def _cores(pgid: int) -> dict[int, set[int]]:
    """The cores each process of a process group may run on."""
    cores = {}
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(p.pid) == pgid:
                cores[p.pid] = set(p.cpu_affinity())
    return cores


@pytest.fixture(scope="module")
def runs(
    tiny_model: str, engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fleet")
    config = Config.parse(str(PIPELINE))
    server = ServerSpec(
        model=tiny_model,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        num_blocks=VLLM_BLOCKS,
        extra_args=["--enforce-eager"],
        env=engine_env,
    )
    trace = multi_turn(read_trace(TRACE, limit=SLICE_FROM))
    vocab = vocab_size_of(tiny_model)
    assert vocab is not None
    prompts, skipped = make_prompts(
        trace, scale=16, vocab_size=vocab, max_output_tokens=OUTPUT, max_model_len=MAX_LEN
    )
    replayed = [r for i, r in enumerate(trace) if i not in set(skipped)]
    out: dict[str, Any] = {"prompts": prompts, "trace": replayed}
    # One request at a time, also to the router: its load counts settle between
    # two (as kvc simulate --fleet --concurrency 1 has them).
    spec = BenchSpec(
        trace=replayed,
        configs=[config],
        server=server,
        concurrency=1,
        workdir=workdir,
        fleet=2,
        pause_s=PAUSE_S,
    )
    with fleet(config, server, 2, workdir) as engines:
        # (Read while they run: the tests run after the module's engines stopped.)
        out["cores"] = [_cores(e.pid) for e in engines]
        before = sum(counters(e.url)["requests"] for e in engines)
        warm_up(replace(spec, warm_up=1), engines, prompts[:4])
        time.sleep(SETTLE_S)
        out["warmed"] = sum(counters(e.url)["requests"] for e in engines) - before
        for name in ("kv_aware-tiers", "kv_aware-vllm"):
            out[f"steer/{name}"] = _steer(engines, name, vocab, workdir)
        for name in POLICIES:
            log = workdir / f"router-{name}.log"
            out[name] = run_policy(spec, engines, POLICIES[name], prompts, log)
    yield out


def _steer(engines: list[Engine], policy: str, vocab: int, workdir: Path) -> dict[str, Any]:
    """With the router up, each engine's own prompt sent to it directly and pushed out
    of its vLLM cache (only its tier holds it); then each prompt's next turn through
    the router: which engine served it, and how many prompt tokens were cached."""
    model = served_model(engines[0].url)
    own = [_ids(1000 + e, PROMPT_BLOCKS, vocab) for e in range(len(engines))]
    for engine in engines:
        empty(engine.url)
    turns = []
    with vllm_router(
        [e.url for e in engines],
        POLICIES[policy].args,
        workdir / f"router-steer-{policy}.log",
        kv_event_sources=event_sources(engines),
        block_size=BLOCK,
    ) as router:
        for e, engine in enumerate(engines):
            assert send(engine.url, model, _prompt(0, own[e])).error is None
            for f in range(FILLERS):
                filler = _ids(2000 + 10 * e + f, PROMPT_BLOCKS, vocab)
                assert send(engine.url, model, _prompt(1 + f, filler)).error is None
        # The fillers' steps published each prompt's blocks; ZMQ delivers them in
        # milliseconds (the router's index cannot be read back).
        time.sleep(SETTLE_S)
        for e in range(len(engines)):
            before = [counters(x.url) for x in engines]
            record = send(router.url, model, _prompt(10 + e, own[e] + _ids(3000 + e, 2, vocab)))
            after = [counters(x.url) for x in engines]
            went = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
            turns.append({"went": went, "cached": record.cached_tokens, "error": record.error})
    return {"turns": turns}


def test_each_turn_goes_to_the_engine_whose_tier_holds_its_prompt(runs: dict[str, Any]) -> None:
    for e, turn in enumerate(runs["steer/kv_aware-tiers"]["turns"]):
        assert turn["error"] is None
        assert turn["went"] == [int(i == e) for i in range(2)], turn
        # Served by the tier (vLLM's own cache no longer held it): every whole block.
        assert turn["cached"] == PROMPT_BLOCKS * BLOCK, turn


def test_without_the_tiers_events_the_router_sees_nothing_cached(runs: dict[str, Any]) -> None:
    turns = runs["steer/kv_aware-vllm"]["turns"]
    assert all(t["error"] is None for t in turns)
    # No engine's vLLM cache holds either prompt: least load, both on one engine,
    # so one turn lands where no tier holds its prompt and is computed again.
    assert turns[0]["went"] == turns[1]["went"], turns
    assert sorted(t["cached"] for t in turns) == [0, PROMPT_BLOCKS * BLOCK], turns


def test_every_process_of_an_engine_runs_on_its_own_core(runs: dict[str, Any]) -> None:
    cores = os.cpu_count() or 1
    for i, group in enumerate(runs["cores"]):
        assert len(group) >= 2, group  # the API server, the engine core and its worker
        assert group == dict.fromkeys(group, {i % cores})


def test_a_warm_up_pass_goes_through_the_router_before_any_run(runs: dict[str, Any]) -> None:
    # (Not measured: every run after it empties the caches and reads its own counters.)
    assert runs["warmed"] == 4


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_request_of_the_slice_is_answered(runs: dict[str, Any], policy: str) -> None:
    result = runs[policy]
    assert len(result.records) == len(runs["prompts"]) and result.errors == 0
    assert sum(result.engine_requests) == len(runs["prompts"])


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_simulator_predicts_the_served_fraction(
    runs: dict[str, Any], policy: str, tiny_model: str, figures: Callable[[str], None]
) -> None:
    result = runs[policy]
    pipeline = load_pipeline(PIPELINE)
    shape = model_shape(tiny_model, BLOCK, pipeline)
    predicted = simulate_fleet(
        pipeline,
        runs["trace"],
        engines=2,
        router=policy,
        bytes_per_block=shape.bytes_per_block,
        block_size=BLOCK,
        trace_block_tokens=32,
        vllm_cache_blocks=VLLM_BLOCKS,
        groups=shape.groups,
        concurrency=1,
        max_output_tokens=OUTPUT,
    )
    measured = result.fraction(result.prefix_cache_tokens + result.connector_tokens)
    # Requests per engine, busiest first: the largest gap, as a share of the slice.
    gap = max(
        abs(m - p)
        for m, p in zip(result.engine_requests, predicted.engine_requests, strict=True)
    ) / len(runs["prompts"])
    figures(
        f"{policy}: measured {100 * measured:.2f}%, predicted "
        f"{100 * predicted.fraction_served:.2f}%; requests by engine {result.engine_requests} "
        f"(predicted {predicted.engine_requests}, {100 * gap:.1f}% of the slice apart)"
    )
    assert abs(measured - predicted.fraction_served) <= 0.01
    if policy == "consistent_hash":
        # The router's ring is one of the workers' URLs, whose ports differ from run
        # to run: which sessions share an engine is the run's, not the trace's (two
        # runs measured [33, 26] and [37, 22] where [31, 28] was predicted). What the
        # model does hold, and the served fraction shows: whole sessions per engine.
        assert round(result.engine_requests[0]) in _session_sums(runs["prompts"])
    else:
        assert gap <= 0.10


def _session_sums(prompts: list[Prompt]) -> set[int]:
    """Every count of requests some set of whole sessions makes."""
    sizes = Counter(p.session or f"#{p.index}" for p in prompts).values()
    sums = {0}
    for size in sizes:
        sums |= {s + size for s in sums}
    return sums
