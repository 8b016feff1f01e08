"""What a router sees of the CPU tier: vLLM's own KV event publisher, a real subscriber.

One engine (real vLLM, in one process) publishes its KV cache events over ZMQ
(``--kv-events-config``); the test subscribes with a ZMQ SUB socket and decodes
with vLLM's own ``KVEventBatch``, as a router does. The engine replays 12
requests of the Mooncake conversation trace twice through an ``offload-cpu``
tier of 128 blocks, smaller than the slice (so it evicts), then two requests
shorter than a block (nothing stored: the tier is quiet). At the second one's
lookup the ``offload-cpu-holdings`` node writes what the tier holds and how
many leading blocks of each prompt it would serve. From the events alone (those
published before that moment) the test rebuilds the tier's index: it must equal
what the tier holds, block for block, and answer "how many leading blocks of
this prompt, in which medium" as the tier does, for every prompt of the slice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)

from composer import discover, kv_transfer_config, load_pipeline
from composer.servers import LOOPBACK, free_port
from composer.testing.engine import EngineResult, EngineSpec, plugin_env, run_engine
from composer.testing.kv_events import Subscriber
from composer.testing.tiny_model import build_tiny_model, trace_prompts

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
#: 128 blocks of the tiny Llama's 16 KiB: the slice needs about twice that.
CAPACITY = "2MiB"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import offload_cpu_e2e_plugins as e2e_plugins

    model = str(build_tiny_model())
    sliced = trace_prompts(12, model)
    rounds: list[list[Any]] = [sliced[:6], sliced[6:], sliced[:6], sliced[6:]]
    quiet = [["tiny"], ["quiet"]]  # shorter than a block: nothing to store
    report = tmp_path_factory.mktemp("kv-events") / "holdings.json"
    pipeline = {
        "version": 1,
        "nodes": {
            "probe": {
                "plugin": "offload-cpu-holdings",
                "needs": ["cpu"],
                "config": {"target": "cpu", "report": str(report), "dump_at": len(sliced) * 2 + 2},
            },
            "cpu": {"plugin": "offload-cpu", "config": {"capacity": CAPACITY}},
        },
    }
    kv = kv_transfer_config(load_pipeline(pipeline, registry=discover(extra=[e2e_plugins])))
    port = free_port(LOOPBACK)
    subscriber = Subscriber(f"tcp://{LOOPBACK}:{port}")
    try:
        result: EngineResult = run_engine(
            EngineSpec(
                model=model,
                rounds=[*rounds, *quiet],
                kv_transfer_config=kv,
                env=plugin_env(HERE, "offload_cpu_e2e_plugins"),
                enforce_eager=True,
                in_process=True,
                kv_events_endpoint=f"tcp://{LOOPBACK}:{port}",
            )
        )
    finally:
        subscriber.stop()
    yield {
        "result": result,
        "batches": subscriber.batches,
        "holdings": json.loads(report.read_text()),
        "prompts": len(sliced),
    }


def _index(batches: list[Any], until: float) -> tuple[set[Any], dict[str, int]]:
    """A router's index of the CPU tier, from the events published before ``until``."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held: set[Any] = set()
    counts = {"stored": 0, "removed": 0}
    for batch in batches:
        if batch.ts >= until:
            continue
        for event in batch.events:
            if getattr(event, "medium", None) != "CPU":
                continue
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
                counts["stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
                counts["removed"] += len(event.block_hashes)
    return held, counts


def test_the_index_rebuilt_from_events_is_what_the_tier_holds(run: dict[str, Any]) -> None:
    holdings = run["holdings"]
    index, counts = _index(run["batches"], holdings["at"])
    log = [line for line in run["result"].log.splitlines() if "event" in line.lower()]
    assert counts["removed"] > 0, (
        f"the slice was to overflow the tier: no eviction was published "
        f"({len(run['batches'])} batches received); engine log: {log[-10:]}"
    )
    assert index == set(holdings["held"]), (
        f"{len(index - set(holdings['held']))} blocks only in the events, "
        f"{len(set(holdings['held']) - index)} only in the tier"
    )


def test_a_router_answers_each_prompts_leading_blocks_as_the_tier_does(run: dict[str, Any]) -> None:
    holdings = run["holdings"]
    index, _ = _index(run["batches"], holdings["at"])
    prompts = holdings["prompts"]
    assert len(prompts) == 2 * run["prompts"] + 1  # the slice twice, then a quiet one
    served = 0
    for i, prompt in enumerate(prompts):
        leading = 0
        for block_hash in prompt["hashes"]:
            if block_hash not in index:
                break
            leading += 1
        # The tier serves whole blocks and leaves at least one token to compute.
        assert prompt["blocks"] == min(leading, (prompt["tokens"] - 1) // BLOCK), i
        served += prompt["blocks"]
    assert served > 0


def test_every_tier_event_is_self_describing(run: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockStored

    stored = [
        e
        for b in run["batches"]
        for e in b.events
        if isinstance(e, BlockStored) and e.medium == "CPU"
    ]
    assert stored
    for event in stored:
        assert event.ownership == "cpu" and event.block_size == BLOCK
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        assert event.group_idx == 0 and event.kv_cache_spec_kind is not None
