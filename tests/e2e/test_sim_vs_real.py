"""`kvc simulate` against reality, on one real engine whose pipeline holds a tier for each
run (every request names its tier in ``kv_load_tiers``/``kv_store_tiers``; vLLM's
own prefix cache off, so every cached token is a tier's; saves sync, as the
simulator's complete at once):

* a scaled slice of the conversation trace through a 64 MiB offload-cpu tier
  smaller than its working set: served fraction within 5 points of the prediction;
* the cache policies' three traces (:mod:`composer.testing.policy_traces`), each
  beside its control on a tier of the same size, per tenant within 1 point of
  the simulator's prediction (which runs the tier's own index and policies):
  (a) a chat tenant beside a scan of one-off long prompts: with ``quotas`` it
  keeps its solo hit rate within 2 points, without them it does not; (b) agent
  sessions that pause while other prompts pass, replayed at their arrival
  times: ``kv_retention: {ttl_s: 60}`` keeps the next turn's prefix, a TTL
  shorter than the pause and plain LRU do not; (c) a pinned system prompt is
  served through a scan that pushes an unpinned one out.

The runs are :func:`composer.testing.policy_traces.runs`' (each run's tenants
named ``<run>.<tenant>``: its blocks are its own, as vLLM's ``cache_salt``
makes them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer import scrape, simulate
from composer.bench import replay
from composer.bench import run as bench_run
from composer.bench import servers as bench_servers
from composer.simulate.shape import bytes_per_block_from_config
from composer.testing.policy_traces import SYNC, measure, predict, prompts_for, runs
from composer.trace import multi_turn, read_trace
from composer.validation import load_pipeline

pytestmark = pytest.mark.e2e

TRACE = Path(__file__).parents[1] / "data" / "traces" / "mooncake-conversation_trace-500.jsonl"
REQUESTS = 300
SCALE = 16  # 512 tokens a hash id -> 32, the block size: one vLLM block per trace block
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
OUTPUT = 4  # outputs are not saved (save: prompt); short keeps it fast
#: The chat tenant: the conversations that come back among the trace's first 250 requests.
CHAT_FROM = 250
#: Each run of the cache policies' traces (one tier each).
RUNS = {run.name: run for run in runs(multi_turn(read_trace(TRACE, limit=CHAT_FROM)))}
OPTIONS = {"scale": SCALE, "output": OUTPUT, "max_model_len": MAX_MODEL_LEN}


@pytest.fixture(scope="module")
def engine(
    tiny_model: str, engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("sim-vs-real")
    slot = bytes_per_block_from_config(Path(tiny_model) / "config.json", BLOCK_SIZE)
    cpu = {"plugin": "offload-cpu", "config": {"capacity": "64MiB", **SYNC}}
    nodes = {"cpu": cpu, **{name: run.node(slot) for name, run in RUNS.items()}}
    pipeline = workdir / "tiers.yaml"
    pipeline.write_text(yaml.safe_dump({"version": 1, "nodes": nodes}, sort_keys=False))
    config = bench_servers.Config("tiers", pipeline, prefix_caching=False)
    spec = bench_servers.ServerSpec(
        model=tiny_model,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        extra_args=["--enforce-eager"],
        env=engine_env,
    )
    vocab = replay.vocab_size_of(tiny_model) or 512
    with bench_servers.server(config, spec, workdir / "serve.log") as base:
        measured = measure(base, list(RUNS.values()), vocab=vocab, **OPTIONS)
        tiers = scrape.nodes(scrape.fetch(base))
        yield {
            "base": base,
            "vocab": vocab,
            "slot": slot,
            "cpu": cpu,
            "measured": measured,
            "tiers": tiers,
        }


def test_simulated_hit_rate_matches_a_real_engine(
    tiny_model: str, engine: dict[str, Any], figures: Callable[[str], None]
) -> None:
    # Its 64 MiB tier is smaller than the slice's working set (~6,400 blocks of 16 KiB):
    # LRU evicts, so the prediction has to get the eviction order right, not only the sharing.
    trace, prompts = prompts_for(
        read_trace(TRACE, limit=REQUESTS), "cpu", vocab=engine["vocab"], **OPTIONS
    )
    assert len(prompts) > 250
    pipeline = load_pipeline({"version": 1, "nodes": {"cpu": engine["cpu"]}})
    predicted = simulate.simulate(
        pipeline,
        trace,
        bytes_per_block=engine["slot"],
        block_size=BLOCK_SIZE,
        trace_block_tokens=replay.trace_block_tokens(SCALE),
        exact=True,
    )
    node = next(n for n in predicted.nodes if n.id == "cpu")
    assert node.evictions > 0 and node.fraction_served > 0.05

    base = engine["base"]
    before = scrape.nodes(scrape.fetch(base))["cpu"].events.get("evictions", 0)
    result = bench_run.measure("cpu", base, prompts, concurrency=1, speedup=1.0, progress=False)
    evictions = scrape.nodes(scrape.fetch(base))["cpu"].events.get("evictions", 0) - before
    assert result.errors == 0, [r.error for r in result.records if r.error][:3]
    assert result.prompt_tokens == predicted.prompt_tokens
    measured = result.fraction(result.node_tokens["cpu"])
    # The requests' own usage says the same (prefix cache off: every cached token is the tier's).
    assert sum(r.cached_tokens or 0 for r in result.records) == result.node_tokens["cpu"]
    assert result.connector_tokens == result.node_tokens["cpu"]
    assert evictions > 0
    gap = abs(measured - node.fraction_served)
    figures(
        f"predicted {100 * node.fraction_served:.2f}% measured {100 * measured:.2f}% "
        f"gap {100 * gap:.2f} pp ({len(prompts)} requests, {evictions:.0f} evictions)"
    )
    assert gap <= 0.05, (node.fraction_served, measured)


@pytest.mark.parametrize("run", list(RUNS))
def test_each_tenants_hit_rate_is_predicted_within_a_point(
    engine: dict[str, Any], run: str, figures: Callable[[str], None]
) -> None:
    predicted = predict(RUNS[run], engine["slot"], BLOCK_SIZE, replay.trace_block_tokens(SCALE))
    measured = engine["measured"][run]
    assert sorted(measured) == sorted(predicted)
    figures(
        f"{run}: "
        + ", ".join(
            f"{t.split('.')[1]} measured {100 * measured[t]:.1f}% predicted {100 * p:.1f}%"
            for t, p in sorted(predicted.items())
        )
    )
    for tenant, p in predicted.items():
        assert abs(measured[tenant] - p) <= 0.01, (tenant, measured[tenant], p)


def test_with_quotas_the_chat_tenant_keeps_its_solo_hit_rate_and_without_them_not(
    engine: dict[str, Any],
) -> None:
    solo = engine["measured"]["solo"]["solo.chat"]
    guarded = engine["measured"]["guarded"]["guarded.chat"]
    shared = engine["measured"]["shared"]["shared.chat"]
    assert solo > 0.3 and abs(guarded - solo) <= 0.02 and solo - shared > 0.02, (
        solo,
        guarded,
        shared,
    )


def test_each_tenant_of_a_tier_with_quotas_is_on_metrics(engine: dict[str, Any]) -> None:
    # /metrics per node and tenant: the chat tenant's served share as its requests'
    # usage says; the scan (every tenant not named: *) served nothing and, at its
    # share, evicted its own blocks; neither holds more than the tier.
    tenants = engine["tiers"]["guarded"].tenants
    chat, others = tenants["guarded.chat"], tenants["*"]
    run = RUNS["guarded"]
    assert chat["requests"] == others["requests"] == len(run.trace) // 2
    assert (
        chat["tokens_hit"] / chat["prompt_tokens"] == engine["measured"]["guarded"]["guarded.chat"]
    )
    assert others.get("tokens_hit", 0) == 0 and others["blocks_evicted"] > 0
    assert chat.get("blocks_evicted", 0) == 0
    assert chat["blocks_held"] + others["blocks_held"] <= run.blocks
    assert chat["blocks_quota"] == int(0.7 * run.blocks)


def test_a_ttl_keeps_a_paused_sessions_prefix_and_a_shorter_one_or_lru_does_not(
    engine: dict[str, Any],
) -> None:
    kept = engine["measured"]["ttl"]["ttl.agent"]
    expired = engine["measured"]["short"]["short.agent"]
    lru = engine["measured"]["lru"]["lru.agent"]
    assert lru < 0.05 and expired < 0.05 < kept, (kept, expired, lru)


def test_a_pinned_prefix_is_served_through_a_scan_and_an_unpinned_one_is_not(
    engine: dict[str, Any],
) -> None:
    kept = engine["measured"]["pinned"]["pinned.app"]
    lost = engine["measured"]["unpinned"]["unpinned.app"]
    assert lost < 0.05 < kept, (kept, lost)
