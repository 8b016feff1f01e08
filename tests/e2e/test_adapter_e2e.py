"""The composed connector inside real vLLM (CPU build, tiny local model).

One module-scoped set of engine runs serves every test here: vLLM's
MultiConnector over an ExampleConnector and a recording connector, the composed
connector over the same children (plus a probe node), and two fault runs.
Both sides of every token comparison run with a connector configured and the
same VLLM_CPU_OMP_THREADS_BIND, so the thread count is equal.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from composer import kv_transfer_config, load_pipeline
from composer.testing.engine import EngineResult, EngineSpec, run_engine
from composer.testing.tiny_model import make_prompts

pytestmark = pytest.mark.e2e

PROMPTS = make_prompts(3, words=50, seed=7)


def native(connector: str, **extra: Any) -> dict[str, Any]:
    return {"plugin": "vllm", "config": {"connector": connector, **extra}}


@pytest.fixture(scope="module")
def runs(
    tiny_model: str, engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("adapter")
    rec_module = {"module_path": "recording_connector"}

    def spec(config: dict[str, Any]) -> EngineSpec:
        return EngineSpec(
            model=tiny_model,
            rounds=[PROMPTS, PROMPTS],
            kv_transfer_config=config,
            env=engine_env,
            enforce_eager=True,
            in_process=True,
        )

    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp / "m-ex")},
                },
                {
                    "kv_connector": "RecordingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_module_path": "recording_connector",
                    "kv_connector_extra_config": {
                        "shared_storage_path": str(tmp / "m-rec"),
                        "record_path": str(tmp / "multi.jsonl"),
                    },
                },
            ]
        },
    }
    composed_pipeline = {
        "version": 1,
        "annotate_outputs": False,
        "nodes": {
            "ex": native(
                "ExampleConnector", extra_config={"shared_storage_path": str(tmp / "c-ex")}
            ),
            "rec": native(
                "RecordingConnector",
                **rec_module,
                extra_config={
                    "shared_storage_path": str(tmp / "c-rec"),
                    "record_path": str(tmp / "composed.jsonl"),
                },
            ),
            "probe": {"plugin": "probe", "config": {"path": str(tmp / "probe.json")}},
        },
    }
    composed = {
        "kv_connector": "ComposedConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"pipeline": composed_pipeline},
    }

    def faulty(mode: str, policy: str) -> dict[str, Any]:
        pipeline = load_pipeline(
            {
                "version": 1,
                "annotate_outputs": True,
                "nodes": {
                    "bad": {"plugin": "faulty", "on_error": policy, "config": {"mode": mode}}
                },
            }
        )
        return kv_transfer_config(pipeline)

    results: dict[str, Any] = {"tmp": tmp}
    results["multi"] = run_engine(spec(multi))
    results["composed"] = run_engine(spec(composed))
    results["fault_recompute"] = run_engine(spec(faulty("raise", "recompute")))
    results["fault_noise"] = run_engine(spec(faulty("noise", "recompute")))
    return results


def records(path: Path) -> list[list[Any]]:
    out = []
    for line in path.read_text().splitlines():
        # Request ids carry a random suffix per engine run: keep the sequence number.
        out.append(json.loads(re.sub(r'"(request:)?(\d+)-[0-9a-f]{8}"', r'"request:\2"', line)))
    # vLLM's MultiConnector never forwards get_kv_connector_kv_cache_events to its
    # children (a TODO in its source); the composed connector does, per node.
    return [r for r in out if r[0] != "get_kv_connector_kv_cache_events"]


def per_request(recs: list[list[Any]]) -> dict[str, list[list[Any]]]:
    calls: dict[str, list[list[Any]]] = defaultdict(list)
    for rec in recs:
        reqs = sorted(set(re.findall(r"request:\d+", json.dumps(rec[1]))))
        for req in reqs:
            # The step's finished set, grouped by timing, counts once for each request.
            calls[req].append([rec[0], req, rec[2]] if rec[0] in FINISHED_SETS else rec)
    return dict(calls)


FINISHED_SETS = ("get_finished", "get_transfer_results")


def split_metadata(value: Any, items: list[str]) -> Any:
    """``value`` with each ExampleConnectorMetadata's request list moved into ``items``."""
    if isinstance(value, list):
        if value and value[0] == "ExampleConnectorMetadata":
            items.extend(json.dumps(item) for item in value[1])
            return ["ExampleConnectorMetadata", "..."]
        return [split_metadata(v, items) for v in value]
    return value


def calls_without_requests(rec: list[Any]) -> str:
    if rec[0] in FINISHED_SETS:
        rec = [rec[0], "finished requests", rec[2]]
    # Which requests a step's metadata covers is timing too (compared in metadata_items).
    rec = split_metadata(rec, [])
    return re.sub(r'"request:\d+"', '"request"', json.dumps(rec))


def metadata_items(recs: list[list[Any]]) -> Counter[str]:
    """Every request entry of every ExampleConnectorMetadata over the run (loads and stores)."""
    items: list[str] = []
    for rec in recs:
        split_metadata(rec, items)
    return Counter(items)


def step_shapes(recs: list[list[Any]], boundary: str) -> set[tuple[str, ...]]:
    """Distinct sequences of request-independent calls between step boundaries."""
    shapes, current = set(), []
    for name, args, _ in recs:
        # Per-request calls come in timing-dependent numbers per step; the
        # finished set is a per-step call whose contents alone are timing.
        if name not in FINISHED_SETS and "request:" in json.dumps(args):
            continue
        if name == boundary and current:
            shapes.add(tuple(current))
            current = []
        if not current or current[-1] != name:  # how often an idle engine polls is timing
            current.append(name)
    shapes.add(tuple(current))
    return shapes


def test_parity_with_multiconnector(runs: dict[str, Any]) -> None:
    multi: EngineResult = runs["multi"]
    composed: EngineResult = runs["composed"]
    assert composed.tokens(0) == multi.tokens(0)
    assert composed.tokens(1) == multi.tokens(1)
    assert [r.cached_tokens for r in composed.rounds[1]] == [
        r.cached_tokens for r in multi.rounds[1]
    ]
    tmp = runs["tmp"]
    # Requests reach the engine core while it steps, so step boundaries differ
    # run to run; what must match is every request's own calls (arguments and
    # results, in order), the shape of every step, and what was loaded/stored.
    for role, boundary in (("scheduler", "build_connector_meta"), ("worker", "handle_preemptions")):
        want = records(tmp / f"multi.jsonl.{role}")
        got = records(tmp / f"composed.jsonl.{role}")
        assert len(want) > 20, f"recording connector saw too few {role} calls"
        assert per_request(got) == per_request(want)
        assert step_shapes(got, boundary) == step_shapes(want, boundary)
        # Which requests finish in which step is timing too: compare the calls
        # without their request ids, and the requests they finished over the run.
        assert {calls_without_requests(r) for r in got} == {calls_without_requests(r) for r in want}
        assert metadata_items(got) == metadata_items(want)
    assert per_request(records(tmp / "multi.jsonl.scheduler")), "no request-level calls recorded"


def test_model_hand_off_and_canonical_view(runs: dict[str, Any]) -> None:
    tmp = runs["tmp"]
    report = json.loads((tmp / "probe.json.worker").read_text())
    assert report["initialize_calls"] == 1
    assert report["model_class"] == "LlamaForCausalLM"
    assert report["model_params"] > 0
    canonical = report["canonical"]
    # The CPU backend's layout: each layer its own region, two layers, one group.
    assert canonical["layers"] == canonical["raw_layers"]
    assert canonical["groups"] == [["attention", 32, list(range(canonical["regions"]))]]
    assert canonical["rows_match_vllm"] is True
    assert not (tmp / "probe.json.scheduler").exists()  # probe is a worker-only plugin


def test_failing_load_is_recomputed_with_identical_tokens(runs: dict[str, Any]) -> None:
    baseline: EngineResult = runs["multi"]
    fault: EngineResult = runs["fault_recompute"]
    # The faulty node did claim the blocks, its load raised, the blocks became
    # load errors: it is not said to have served them, and the failed load is named.
    for r in fault.rounds[0]:
        note = r.kv_transfer_params["kv_composer"]
        assert note["served_by"] is None and note["tokens"] == 0, note
        assert note["failed"] == {"node": "bad", "tokens": r.cached_tokens}, note
    # vLLM recomputed them: the tokens of a run without the fault.
    assert fault.tokens(0) == baseline.tokens(0)
    assert fault.tokens(1) == baseline.tokens(1)


def test_noise_loaded_into_claimed_blocks_changes_tokens(runs: dict[str, Any]) -> None:
    """The identical-token check can fail: serving garbage KV changes the output."""
    baseline: EngineResult = runs["multi"]
    noise: EngineResult = runs["fault_noise"]
    assert noise.tokens(0) != baseline.tokens(0)
