"""A disk tier (LMCache's ``fs`` L2 adapter) that outlives its engine and server (real vLLM).

* The writer engine (its own `lmcache server`, ``l2: [{type: fs, path: D,
  seal_key_file: K}]``) computes P and exits; its server is stopped with it.
* The reader is a fresh engine with a fresh, empty server on the same D and
  K: round 0 repeats P and is served from disk. Then (``fleet-faults`` node,
  before round 1) its L1 is emptied and every chunk file damaged: every other
  one truncated, the rest with bytes flipped. Round 1 repeats P again: AES-GCM
  rejects the flipped chunks and the short reads fail, so everything is
  recomputed, with the tokens of a plain engine.
* Then the disk goes away and comes back, twice (the directory replaced by a
  file, then put back, with L1 emptied before each round): Q is computed
  while it is away (its saves fail, logged by LMCache; the server and the node
  stay up), computed again once it is back (nothing was stored, nothing
  queued) and saved, then served from disk; the same for R.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from kvc_lmcache.server import _alive

from composer import kv_transfer_config, load_pipeline
from composer.discovery import discover
from composer.testing.engine import EngineResult, EngineSpec, SharedRuns, plugin_env, run_engine
from composer.testing.tiny_model import build_tiny_model, make_prompts

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
N = 3
P = make_prompts(N, words=120, seed=71)
Q = make_prompts(N, words=120, seed=72)
R = make_prompts(N, words=120, seed=73)
READER_ROUNDS = [P, P, Q, Q, Q, R, R, R]
#: Rounds computed while the disk was away.
AWAY_ROUNDS = (2, 5)
#: The reference: the reader's rounds without a connector (the shared ``plain_llama`` engine).
PLAIN_LLAMA_ROUNDS = READER_ROUNDS


def _kv(disk: Path, key: Path, faults: dict[str, Any] | None) -> dict[str, Any]:
    import kvc_fleet_faults

    nodes: dict[str, Any] = {
        "lmcache": {
            "plugin": "lmcache",
            "config": {
                "chunk_size": BLOCK,
                "server": {
                    "l1_size_gb": 0.25,
                    "l2": [{"type": "fs", "path": str(disk), "seal_key_file": str(key)}],
                },
            },
        }
    }
    if faults is not None:
        nodes["faults"] = {"plugin": "fleet-faults", "needs": ["lmcache"], "config": faults}
    pipeline = {
        "version": 1,
        "annotate_outputs": True,
        "nodes": nodes,
        "load_order": ["faults", "lmcache"] if faults else ["lmcache"],
    }
    return kv_transfer_config(load_pipeline(pipeline, registry=discover(extra=[kvc_fleet_faults])))


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, plain_llama: SharedRuns
) -> Iterator[dict[str, Any]]:
    model = str(build_tiny_model())
    state = tmp_path_factory.mktemp("lmcache-state")
    env = {"KVC_LMCACHE_STATE_DIR": str(state), **plugin_env(HERE, "kvc_fleet_faults")}
    root = tmp_path_factory.mktemp("disk-tier")
    disk, key, report = root / "chunks", root / "seal.key", root / "report"
    key.write_bytes(os.urandom(32))
    out: dict[str, Any] = {"state": state, "disk": disk}

    def run(rounds: list[list[str]], kv: dict[str, Any] | None) -> EngineResult:
        return run_engine(
            EngineSpec(
                model=model,
                rounds=rounds,
                kv_transfer_config=kv,
                env=env,
                max_tokens=8,
                enforce_eager=True,
                in_process=True,
            )
        )

    out["plain"] = plain_llama(PLAIN_LLAMA_ROUNDS)
    out["writer"] = run([P], _kv(disk, key, None))
    out["files_after_writer"] = sorted(p.name for p in disk.rglob("*") if p.is_file())
    faults = {
        "report": str(report),
        "actions": {
            str(N + 1): ["clear_l1", "corrupt_fs"],
            **{str(r * N + 1): ["clear_l1", "fs_gone"] for r in AWAY_ROUNDS},
            **{str((r + 1) * N + 1): ["clear_l1", "fs_back"] for r in AWAY_ROUNDS},
            **{str((r + 2) * N + 1): ["clear_l1"] for r in AWAY_ROUNDS},
        },
        "fs_path": str(disk),
    }
    out["reader"] = run(READER_ROUNDS, _kv(disk, key, faults))
    out["reader/report"] = json.loads(Path(f"{report}.scheduler.json").read_text())
    yield out


def _served(result: EngineResult, r: int) -> list[str | None]:
    return [
        (x.kv_transfer_params or {}).get("kv_composer", {}).get("served_by")
        for x in result.rounds[r]
    ]


def test_tokens_equal_a_plain_engine(runs: dict[str, Any]) -> None:
    assert runs["writer"].tokens(0) == runs["plain"].tokens(0)
    for r in range(len(READER_ROUNDS)):
        assert runs["reader"].tokens(r) == runs["plain"].tokens(r), f"reader round {r}"


def test_the_writer_leaves_its_chunks_on_disk_and_no_server(runs: dict[str, Any]) -> None:
    whole_chunks = sum(r.prompt_tokens // BLOCK for r in runs["writer"].rounds[0])
    assert len(runs["files_after_writer"]) >= whole_chunks
    for path in Path(runs["state"]).glob("*.json"):
        assert not _alive(json.loads(path.read_text()).get("pid")), "a server outlived its engine"


def test_a_fresh_engine_and_server_are_served_from_disk(runs: dict[str, Any]) -> None:
    assert _served(runs["writer"], 0) == [None] * N
    assert _served(runs["reader"], 0) == ["lmcache"] * N
    for r in runs["reader"].rounds[0]:
        assert r.cached_tokens == (r.prompt_tokens - 1) // BLOCK * BLOCK, r


def test_damaged_chunks_are_recomputed_never_served(runs: dict[str, Any]) -> None:
    corrupted = runs["reader/report"]["corrupted"]
    assert corrupted["truncated"] > 0 and corrupted["flipped"] > 0, corrupted
    assert _served(runs["reader"], 1) == [None] * N
    assert [r.cached_tokens for r in runs["reader"].rounds[1]] == [0] * N
    assert runs["reader/report"]["gauges"]["l2_adapters"] == 1


@pytest.mark.parametrize("away", AWAY_ROUNDS)
def test_a_disk_that_goes_away_and_comes_back_serves_again(runs: dict[str, Any], away: int) -> None:
    reader = runs["reader"]
    # Away: computed, its saves failed. Back: computed again (nothing was stored
    # or queued while away), and saved. Then served from disk, L1 emptied.
    assert _served(reader, away) == [None] * N
    assert _served(reader, away + 1) == [None] * N
    assert _served(reader, away + 2) == ["lmcache"] * N
    assert reader.clean_exit
    gauges = runs["reader/report"]["gauges"]
    assert gauges["l2_failed"] > 0, gauges  # the stores that met the missing directory
