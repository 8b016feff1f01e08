"""A node fault never changes generated tokens, loses a request or leaks a block.

Real vLLM (CPU build, tiny local model, prefix cache off), a real tier behind
every faulty node (``faulty-tier`` is ``offload-cpu`` with one injected fault,
see ``fault_plugins.py``). One engine per ``on_error`` policy x load/save mode
runs every cell of the matrix: each cell is its own node, active over its own
two rounds (a prompt pair computed and saved, then repeated and served), failing
in one hook on its first call or on a later one. Against a plain engine with
the same CPU threads: identical tokens in every round; every request answered;
vLLM's free block count back to its idle value at the end; the engine and its
processes exit on their own; every fault fired and was logged.

``on_error: fail`` stops the engine with a message naming node and hook: one
scheduler-side and one worker-side fault, through real engines; every hook in
the chain-level tests (``tests/test_fault_policies.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from composer import kv_transfer_config, load_pipeline
from composer.testing import kept
from composer.testing.engine import EngineFailed, EngineResult, EngineSpec, SharedRuns, run_engine
from composer.testing.tiny_model import GEMMA3_SHAPE, build_tiny_model, make_prompts

pytestmark = pytest.mark.e2e

#: Hooks vLLM 0.32.0 calls on CPU per request or per step: a fault on the first
#: call and on a later one. (Hooks vLLM never calls here, e.g. the HMA and
#: handshake ones, are covered by the chain-level tests.)
PER_STEP = [
    # scheduler
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
    "get_kv_connector_stats",
    # worker
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "get_kv_connector_kv_cache_events",
]
#: Called once: at start-up, or at shutdown.
ONCE = ["register_kv_caches", "bind_kv_cache_manager", "shutdown"]
LATER = 3
CELLS = [(h, 1) for h in PER_STEP] + [(h, LATER) for h in PER_STEP] + [(h, 1) for h in ONCE]
PAIR = 2  # prompts per round
PROMPTS = make_prompts(PAIR * len(CELLS) + 2, words=90, seed=41)
ROUNDS: list[list[str]] = []
for i in range(len(CELLS)):
    pair = PROMPTS[PAIR * i : PAIR * (i + 1)]
    ROUNDS += [pair, pair]  # computed and saved, then served
# Two last requests that no faulty node takes part in: by the second, every
# block freed by the run is back in vLLM's pool.
ROUNDS += [[PROMPTS[-2]], [PROMPTS[-1]]]
#: The reference: these rounds without a connector (the shared ``plain_llama`` engine).
PLAIN_LLAMA_ROUNDS = ROUNDS
MODES = {
    "sync": {"load_mode": "sync", "save_mode": "sync"},
    "async": {"load_mode": "async", "save_mode": "async"},
}


def _pipeline(
    policy: str, mode: str | list[str], tmp: Path, cells: list[tuple[str, int]]
) -> dict[str, Any]:
    """One faulty node per cell; ``mode``: every node's load/save mode, or each cell's."""
    watch = {"plugin": "block-watch", "config": {"path": str(tmp / "free.jsonl")}}
    nodes: dict[str, Any] = {"watch": watch, "kept": kept.node()}
    modes = [mode] * len(cells) if isinstance(mode, str) else mode
    for i, (hook, call) in enumerate(cells):
        nodes[f"f{i}"] = {
            "plugin": "faulty-tier",
            "on_error": policy,
            "config": {
                "capacity": "8MiB",
                **MODES[modes[i]],
                "fault_hook": hook,
                "fault_call": call,
                "active_from": 2 * PAIR * i,
                "active_to": 2 * PAIR * (i + 1),
                "fired": str(tmp / "fired.jsonl"),
            },
        }
    pipeline = {"version": 1, "annotate_outputs": True, "nodes": nodes}
    return kv_transfer_config(load_pipeline(pipeline))


MODULES = f"plugins_for_tests,fault_plugins,{kept.MODULE}"


def _env(engine_env: dict[str, str]) -> dict[str, str]:
    return {**engine_env, "KV_COMPOSER_PLUGIN_MODULES": MODULES}


@pytest.fixture(scope="module")
def plain(plain_llama: SharedRuns) -> EngineResult:
    return plain_llama(ROUNDS)


@pytest.fixture(scope="module", autouse=True)
def _fault_plugins(monkeypatch_module: pytest.MonkeyPatch) -> None:
    monkeypatch_module.setenv("KV_COMPOSER_PLUGIN_MODULES", MODULES)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("policy", ["recompute", "disable"])
def test_matrix(
    policy: str,
    mode: str,
    plain: EngineResult,
    tiny_model: str,
    engine_env: dict[str, str],
    tmp_path: Path,
    figures: Callable[[str], None],
) -> None:
    config = _pipeline(policy, mode, tmp_path, CELLS)
    result = run_engine(
        EngineSpec(
            model=tiny_model,
            rounds=ROUNDS,
            kv_transfer_config=config,
            env=_env(engine_env),
            enforce_eager=True,
            in_process=True,
            timeout_s=600,
        )
    )
    wrong = [
        f"cell {r // 2} {CELLS[r // 2] if r // 2 < len(CELLS) else 'drain'} round {r}"
        for r in range(len(ROUNDS))
        if result.tokens(r) != plain.tokens(r)
    ]
    assert not wrong, f"tokens differ from the plain engine in: {wrong}"
    assert all(len(t) == 8 for rnd in result.rounds for t in (r.tokens for r in rnd))

    fired = [json.loads(line) for line in (tmp_path / "fired.jsonl").read_text().splitlines()]
    fired_nodes = {f["node"] for f in fired}
    missing = [(i, c) for i, c in enumerate(CELLS) if f"f{i}" not in fired_nodes]
    assert not missing, f"faults that never fired: {missing}"
    for i, (hook, _) in enumerate(CELLS):
        seen = re.search(rf"node=f{i}\b.*hook={hook}|hook={hook}.*node=f{i}\b", result.log)
        assert seen, f"fault of f{i} in {hook} not in the log"

    free = [json.loads(line) for line in (tmp_path / "free.jsonl").read_text().splitlines()]
    idle, last = free[0][1], free[-1][1]
    assert last == idle, f"{idle - last} KV blocks still held after every request finished"
    assert result.clean_exit, "the engine's processes had to be killed"
    # The tier really served: repeats of cells whose fault came late were hits.
    served = sum(r.cached_tokens for rnd in result.rounds[1::2] for r in rnd)
    assert served > 0
    _assert_reported_is_delivered(result, figures)


def _assert_reported_is_delivered(result: EngineResult, figures: Callable[[str], None]) -> None:
    """Request by request: what KV Composer says a node served (``served_by``,
    ``tokens``) is what vLLM kept (``kept-tokens``' count), and a failed load is named;
    node by node: the settled counters on ``/metrics`` add up to those requests'."""
    wrong, vllm_counts_failed = kept.reported_vs_kept(result.rounds)
    assert not wrong, f"(round, request, reported, kept): {wrong}"
    miscounted = kept.counted_vs_reported(result.rounds, result.metrics)
    assert not miscounted, f"node: (counted on /metrics, reported): {miscounted}"
    figures(f"requests whose failed load vLLM's cached_tokens counts: {vllm_counts_failed}")


@pytest.mark.parametrize(
    ("hook", "call"), [("update_state_after_alloc", LATER), ("start_load_kv", 1)]
)
def test_fail_stops_the_engine_with_a_clear_message(
    hook: str, call: int, tiny_model: str, engine_env: dict[str, str], tmp_path: Path
) -> None:
    config = _pipeline("fail", "sync", tmp_path, [(hook, call)])
    with pytest.raises(EngineFailed) as failed:
        run_engine(
            EngineSpec(
                model=tiny_model,
                rounds=ROUNDS[:2],
                kv_transfer_config=config,
                env=_env(engine_env),
                enforce_eager=True,
                in_process=True,
                timeout_s=300,
            )
        )
    assert f'KV Composer node "f0" (plugin faulty-tier) failed in {hook}' in failed.value.log
    assert "on_error policy is fail" in failed.value.log


#: On a hybrid model: the scheduler-side hooks and a load fault, first call each, with
#: sync loads and saves, then the same with async ones (each cell its own node).
HYBRID_SUBSET = [(h, 1) for h in PER_STEP[:6]] + [("start_load_kv", 1)]
HYBRID_MODES = ["sync"] * len(HYBRID_SUBSET) + ["async"] * len(HYBRID_SUBSET)
HYBRID_CELLS = HYBRID_SUBSET * 2
HYBRID_ROUNDS = ROUNDS[: 2 * len(HYBRID_CELLS)] + ROUNDS[-2:]


def test_hybrid_model_subset(
    engine_env: dict[str, str], tmp_path: Path, figures: Callable[[str], None]
) -> None:
    """A Gemma-3-shaped model (sliding-window and full-attention KV cache groups, vLLM's
    hybrid manager on): every fault is recomputed, per request (vLLM takes no failed
    block ids with several groups). Each cell's repeat must give the tokens its first
    round computed, in the same engine. Both modes' cells run in one engine."""
    config = _pipeline("recompute", HYBRID_MODES, tmp_path, HYBRID_CELLS)
    result = run_engine(
        EngineSpec(
            model=str(build_tiny_model(GEMMA3_SHAPE)),
            rounds=HYBRID_ROUNDS,
            kv_transfer_config=config,
            env=_env(engine_env),
            enforce_eager=True,
            in_process=True,
            timeout_s=600,
        )
    )
    assert "groups=sliding_window,attention" in result.log  # the hybrid manager stayed on
    for i, (cell, mode) in enumerate(zip(HYBRID_CELLS, HYBRID_MODES, strict=True)):
        assert result.tokens(2 * i + 1) == result.tokens(2 * i), f"cell {i} {cell} {mode}"
    lines = (tmp_path / "fired.jsonl").read_text().splitlines()
    fired = {json.loads(line)["node"] for line in lines}
    assert fired == {f"f{i}" for i in range(len(HYBRID_CELLS))}
    free = [json.loads(line) for line in (tmp_path / "free.jsonl").read_text().splitlines()]
    assert free[-1][1] == free[0][1], "KV blocks still held after every request finished"
    assert result.clean_exit
    for mode in MODES:
        # Each mode's tier really served: the repeats of its cells had hits.
        repeats = [2 * i + 1 for i, m in enumerate(HYBRID_MODES) if m == mode]
        served = sum(r.cached_tokens for i in repeats for r in result.rounds[i])
        assert served > 0, mode
    _assert_reported_is_delivered(result, figures)
