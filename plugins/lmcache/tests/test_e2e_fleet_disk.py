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
* Then the disk is made read-only for two rounds, and back; then full for two
  rounds, and back (L1 emptied before each round). The reader's server runs
  in a user and mount namespace of its own, where a 16 MiB tmpfs, holding a
  copy of the writer's disk, lies over the disk's directory (as root, ``chmod``
  would not stop a write): the test remounts it read-only and read-write
  (``nsenter``) and fills it with a file, then deletes it (through
  ``/proc/<server pid>/root``). U is computed while the disk is read-only (its
  saves fail), computed again with R beside it (U was never stored: a miss;
  R, on disk since round 6, is served: a read-only disk still reads),
  computed again once the disk is writable (and saved), then served. The
  same for V with the disk full.
* Every request of the reader (six in flight in the mixed rounds) gets the
  tokens of a plain engine and finishes well before ``mq_timeout``; after two
  last rounds of one request each, every KV block lent is back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from fleet_checks import blocks_not_back, recomputed, served, stalled
from kvc_fleet_faults import FS_FAULTS, server_on_own_tmpfs
from kvc_lmcache.server_process import is_lmcache_server

from composer import discover, kv_transfer_config, load_pipeline
from composer.servers import alive, stop_process
from composer.testing.engine import (
    EngineResult,
    EngineSpec,
    Prompt,
    SharedRuns,
    plugin_env,
    run_engine,
)
from composer.testing.tiny_model import build_tiny_model, make_prompts

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
N = 3
MAX_TOKENS = 8
MQ_TIMEOUT = 30.0


def _prompts(n: int, seed: int) -> list[Prompt]:
    return list(make_prompts(n, words=120, seed=seed))


P, Q, R, U, V = (_prompts(N, seed) for seed in range(71, 76))
#: Two last rounds of one request each (see ``fleet_checks.blocks_not_back``).
SENTINELS = [[p] for p in _prompts(2, 76)]
READER_ROUNDS = [
    *[P, P, Q, Q, Q, R, R, R],
    *[U, U + R, U, U],  # read-only from round 8 to round 10
    *[V, V + R, V, V],  # full from round 12 to round 14
    *SENTINELS,
]
#: Rounds computed while the disk was away (it is back one round later).
AWAY_ROUNDS = (2, 5)
#: The first round of the disk read-only, and full (it is back two rounds later).
READ_ONLY, FULL = 8, 12
#: Each disk fault, in order: its ``fleet-faults`` action, its first round, its first round back.
FAULTS = {
    "gone 1": ("fs_gone", AWAY_ROUNDS[0], AWAY_ROUNDS[0] + 1),
    "gone 2": ("fs_gone", AWAY_ROUNDS[1], AWAY_ROUNDS[1] + 1),
    "read-only": ("fs_readonly", READ_ONLY, READ_ONLY + 2),
    "full": ("fs_full", FULL, FULL + 2),
}
#: The reader server's tmpfs: a few hundred KiB of chunks, filled by ``fs_full``.
TMPFS_SIZE = "16m"
#: The reference: the reader's rounds without a connector (the shared ``plain_llama`` engine).
PLAIN_LLAMA_ROUNDS = READER_ROUNDS


def _first(r: int) -> str:
    """The ordinal (1-based) of round ``r``'s first request: its actions' key."""
    return str(1 + sum(len(rnd) for rnd in READER_ROUNDS[:r]))


def _kv(
    disk: Path, key: Path, faults: dict[str, Any] | None, command_prefix: list[str] | None = None
) -> dict[str, Any]:
    import kvc_fleet_faults

    nodes: dict[str, Any] = {
        "lmcache": {
            "plugin": "lmcache",
            "config": {
                "chunk_size": BLOCK,
                "server": {
                    "l1_size_gb": 0.25,
                    "mq_timeout": MQ_TIMEOUT,
                    "l2": [{"type": "fs", "path": str(disk), "seal_key_file": str(key)}],
                    "command_prefix": command_prefix or [],
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
    # The reader's server lays its tmpfs over `mount` (the disk's directory is
    # inside it: a mount point cannot be renamed away by `fs_gone`).
    mount, stage = root / "disk", root / "stage"
    disk, key, report = mount / "chunks", root / "seal.key", root / "report"
    stage.mkdir()
    key.write_bytes(os.urandom(32))
    out: dict[str, Any] = {"state": state, "disk": disk}

    def run(
        rounds: list[list[Prompt]], kv: dict[str, Any] | None, more_env: dict[str, str]
    ) -> EngineResult:
        return run_engine(
            EngineSpec(
                model=model,
                rounds=rounds,
                kv_transfer_config=kv,
                env={**env, **more_env},
                max_tokens=MAX_TOKENS,
                enforce_eager=True,
                in_process=True,
            )
        )

    actions: dict[str, list[str]] = {_first(1): ["clear_l1", "corrupt_fs"]}
    for r in range(2, len(READER_ROUNDS) - len(SENTINELS)):
        actions[_first(r)] = ["clear_l1"]  # every lookup of these rounds goes to the disk
    for fault, start, back in FAULTS.values():
        actions[_first(start)].append(fault)
        actions[_first(back)].append(FS_FAULTS[fault])
    faults = {
        "report": str(report),
        "actions": actions,
        "fs_path": str(disk),
        "fs_mount": str(mount),
    }
    tmpfs = server_on_own_tmpfs(mount, stage, TMPFS_SIZE)
    try:
        out["plain"] = plain_llama(PLAIN_LLAMA_ROUNDS)
        out["writer"] = run([P], _kv(disk, key, None), {})
        out["files_after_writer"] = sorted(p.name for p in disk.rglob("*") if p.is_file())
        out["reader"] = run(READER_ROUNDS, _kv(disk, key, faults, tmpfs), {})
        out["reader/report"] = json.loads(Path(f"{report}.scheduler.json").read_text())
        yield out
    finally:
        # Each server stops with its engine (and dies with the process that
        # started it); should one outlive a failed run, it is stopped here,
        # and its tmpfs goes with its mount namespace.
        for path in state.glob("*.json"):
            info = json.loads(path.read_text())
            if is_lmcache_server(info.get("pid"), info.get("port")):
                stop_process(info["pid"])


def test_tokens_equal_a_plain_engine(runs: dict[str, Any]) -> None:
    assert runs["writer"].tokens(0) == runs["plain"].tokens(0)
    for r in range(len(READER_ROUNDS)):
        assert runs["reader"].tokens(r) == runs["plain"].tokens(r), f"reader round {r}"


def test_the_writer_leaves_its_chunks_on_disk_and_no_server(runs: dict[str, Any]) -> None:
    whole_chunks = sum(r.prompt_tokens // BLOCK for r in runs["writer"].rounds[0])
    assert len(runs["files_after_writer"]) >= whole_chunks
    for path in Path(runs["state"]).glob("*.json"):
        assert not alive(json.loads(path.read_text()).get("pid")), "a server outlived its engine"


def test_a_fresh_engine_and_server_are_served_from_disk(runs: dict[str, Any]) -> None:
    assert served(runs["writer"], 0) == [None] * N
    assert served(runs["reader"], 0) == ["lmcache"] * N
    for r in runs["reader"].rounds[0]:
        assert r.cached_tokens == (r.prompt_tokens - 1) // BLOCK * BLOCK, r


def test_damaged_chunks_are_recomputed_neverserved(runs: dict[str, Any]) -> None:
    corrupted = runs["reader/report"]["corrupted"]
    assert corrupted["truncated"] > 0 and corrupted["flipped"] > 0, corrupted
    assert runs["reader/report"]["l1_not_emptied"] == []  # each clear left L1 empty
    assert served(runs["reader"], 1) == [None] * N
    assert [r.cached_tokens for r in runs["reader"].rounds[1]] == [0] * N
    assert runs["reader/report"]["gauges"]["l2_adapters"] == 1


@pytest.mark.parametrize("away", AWAY_ROUNDS)
def test_a_disk_that_goes_away_and_comes_back_serves_again(runs: dict[str, Any], away: int) -> None:
    reader = runs["reader"]
    fault = runs["reader/report"]["fs_faults"][AWAY_ROUNDS.index(away)]
    # A write into the directory failed while it was away, not before nor after.
    assert (fault["write_error_before"], fault["write_error"], fault["write_error_after"]) == (
        None,
        "ENOTDIR",
        None,
    ), fault
    # Away: computed, its saves failed. Back: computed again (nothing was stored
    # or queued while away), and saved. Then served from disk, L1 emptied.
    assert served(reader, away) == [None] * N
    assert served(reader, away + 1) == [None] * N
    assert served(reader, away + 2) == ["lmcache"] * N
    assert reader.clean_exit
    gauges = runs["reader/report"]["gauges"]
    assert gauges["l2_failed"] > 0, gauges  # the stores that met the missing directory


def test_the_server_has_a_disk_of_its_own(runs: dict[str, Any]) -> None:
    # The reader's server ran in its own mount namespace, with the writer's
    # chunks copied onto its tmpfs (round 0 was served from them): the damage
    # and faults below happened there; the machine's mounts are untouched.
    assert runs["reader/report"]["server_own_mount_ns"] is True
    # On the machine's disk, the directory holds what the writer left, as it left it.
    assert (
        sorted(p.name for p in runs["disk"].rglob("*") if p.is_file()) == runs["files_after_writer"]
    )


@pytest.mark.parametrize("name", ["read-only", "full"])
def test_a_read_only_or_full_disk_serves_what_it_holds_and_stores_nothing(
    runs: dict[str, Any], name: str
) -> None:
    reader = runs["reader"]
    _, start, back = FAULTS[name]
    fault = runs["reader/report"]["fs_faults"][list(FAULTS).index(name)]
    # The fault was in place: a write into the disk's directory failed with it,
    # not before it nor after it.
    expected = {"read-only": "EROFS", "full": "ENOSPC"}[name]
    assert (fault["write_error_before"], fault["write_error"], fault["write_error_after"]) == (
        None,
        expected,
        None,
    ), fault
    # While it lasted the new prompts (round `start`) were computed and their
    # saves failed (counted by the server): no chunk file was added.
    assert served(reader, start) == [None] * N
    assert fault["chunks_at_end"] == fault["chunks_at_start"], fault
    assert fault["l2_failed_at_end"] > fault["l2_failed_at_start"], fault
    # Repeated with L1 emptied, still in the fault: nothing is served that was
    # not stored; R, on disk from before, is served: the disk still reads.
    assert served(reader, start + 1) == [None] * N + ["lmcache"] * N
    for x in reader.rounds[start + 1][:N]:
        assert x.cached_tokens == 0, x
    for x in reader.rounds[start + 1][N:]:
        assert x.cached_tokens == (x.prompt_tokens - 1) // BLOCK * BLOCK, x
    # Back (without restarting vLLM or the server): the first round is computed
    # and saved, the next one served from disk.
    assert served(reader, back) == [None] * N
    assert fault["stored_again_s"] is not None, f"nothing stored in 60 s after: {fault}"
    assert served(reader, back + 1) == ["lmcache"] * N


def test_no_request_is_lost_or_stalls(runs: dict[str, Any]) -> None:
    latency = runs["reader/report"]["latency"]
    assert len(latency) == sum(len(rnd) for rnd in READER_ROUNDS)
    # A functional hang check: a wait on a store that is away lasts mq_timeout.
    slow = stalled(latency, MQ_TIMEOUT)
    assert not slow, f"requests that waited on the disk: {slow}"
    assert runs["reader"].clean_exit


def test_every_kv_block_comes_back(runs: dict[str, Any]) -> None:
    free = runs["reader/report"]["free_blocks"]
    assert len(free) == sum(len(rnd) for rnd in READER_ROUNDS)
    problem = blocks_not_back(free, runs["reader"], BLOCK, MAX_TOKENS)
    assert problem is None, problem


def test_each_disk_fault_costs_its_repeats_and_the_disk_stores_again(
    runs: dict[str, Any], figures: Callable[[str], None]
) -> None:
    faults = runs["reader/report"]["fs_faults"]
    assert [f["fault"] for f in faults] == [action for action, _, _ in FAULTS.values()]
    lines = []
    for (name, (_, start, back)), fault in zip(FAULTS.items(), faults, strict=True):
        # Requests computed that a disk that never failed would have served: the
        # repeats of prompts saved while it failed, up to the round after its return.
        cost = recomputed(runs["reader"], READER_ROUNDS, range(start, back + 1))
        resumed = fault["stored_again_s"]
        lines.append(
            f"{name}: {cost} requests recomputed, first chunk stored "
            + (f"{resumed:.2f} s after its return" if resumed is not None else "never")
        )
    figures("fs L2 disk faults: " + "; ".join(lines))
    for fault in faults:
        assert fault["stored_again_s"] is not None, fault
