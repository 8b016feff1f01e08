"""Where the tier puts a request's blocks: slot recording, dealing into runs, and the
slot-patterns benchmark's replay (issue 37: a copy is fast on runs of slots).

:class:`~kvc_offload_cpu.slot_patterns.SlotRecorder` is ``kvc simulate``'s model on a
slot-numbering index; dealing a batch's slots bundle by bundle must change no
eviction decision (the same entries, hits and evictions as the simulator's
counted slots and as the allocation before it), and on a full pool it must
give runs where the allocation alone gives scattered slots (a hybrid's bundles).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.index import BlockIndex
from kvc_offload_cpu.simulate import OffloadCPUModel
from kvc_offload_cpu.slot_patterns import ALL, Pattern, SlotRecorder, run_lengths
from pydantic import ByteSize

from composer import SimKVGroup

BLOCK = 16
WINDOW = 64  # tokens: 4 blocks
PLAIN = [SimKVGroup("attention", 1)]
#: Two full-attention groups (a bundle of 2) and three sliding-window groups (of 3).
HYBRID = [SimKVGroup("attention", 1)] * 2 + [SimKVGroup("sliding_window", 1, WINDOW)] * 3
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "slot_patterns.py"
SLICE = Path(__file__).resolve().parents[3] / "tests/data/traces"
SLICE /= "mooncake-conversation_trace-500.jsonl"

Request = tuple[list[bytes], int, int]


def conversations(n: int, seed: int = 0) -> list[Request]:
    """``n`` requests of multi-turn conversations (each turn its session's last prompt
    and a few new blocks), every session after a two-block system prompt: shared
    prefixes, hits of every length, blocks touched and blocks left to age."""
    rng = random.Random(seed)
    sessions: list[list[bytes]] = []
    out: list[Request] = []
    for _ in range(n):
        if not sessions or rng.random() < 0.3:
            sessions.append([b"system:0", b"system:1"])
            s = len(sessions) - 1
        else:
            s = rng.randrange(len(sessions))
        keys = sessions[s]
        keys += [f"{s}:{len(keys) + i}".encode() for i in range(rng.randint(1, 12))]
        prompt = len(keys) * BLOCK + rng.randrange(BLOCK)
        out.append((list(keys), prompt, (prompt - 1) // BLOCK))
    return out


def config(slots: int, eviction: str = "lru") -> OffloadCPUConfig:
    return OffloadCPUConfig(capacity=ByteSize(slots), eviction=eviction)


def recorder(slots: int, groups: list[SimKVGroup], **kw: Any) -> SlotRecorder:
    return SlotRecorder(config(slots), block_size=BLOCK, bytes_per_block=1, groups=groups, **kw)


def test_run_lengths_are_the_maximal_runs_in_order() -> None:
    assert run_lengths([]) == []
    assert run_lengths([5]) == [1]
    assert run_lengths([3, 4, 5, 9, 10, 2, 3, 3]) == [3, 2, 2, 1]
    p = Pattern()
    p.add([7, 8, 9, 1, 2])
    p.add(list(range(40)))
    s = p.summary()
    assert (s["batches"], s["runs_mean"], s["sorted_runs_mean"], s["one_run"]) == (2, 1.5, 1.5, 0.5)
    assert s["in_runs_8"] == s["in_runs_32"] == 40 / 45


@pytest.mark.parametrize("groups", [PLAIN, HYBRID], ids=["plain", "hybrid"])
@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_dealt_slots_decide_as_the_simulator_and_as_the_allocation_before(
    groups: list[SimKVGroup], eviction: str
) -> None:
    """The same hits, entries (key for key), slots used and evictions after every
    request: the simulator's counted slots, the recorder's as allocated, and dealt."""
    slots = 60 * len(groups)
    sim = OffloadCPUModel(
        config(slots, eviction), block_size=BLOCK, bytes_per_block=1, groups=groups
    )
    models = [
        SlotRecorder(
            config(slots, eviction), block_size=BLOCK, bytes_per_block=1, groups=groups, dealt=dealt
        )
        for dealt in (False, True)
    ]
    for i, (keys, prompt, limit) in enumerate(conversations(300)):
        hit = sim.lookup(keys, 0, limit)
        if hit:
            sim.load(keys, 0, hit)
        sim.save(keys, prompt, hit)
        for m in models:
            assert m.serve(keys, prompt, limit) == hit, i
            assert set(m.index._entries) == set(sim.index._entries), i
            assert (m.index.used_slots, m.index.evictions) == (
                sim.index.used_slots,
                sim.index.evictions,
            ), i
    assert sim.index.evictions > 10 * slots


@pytest.mark.parametrize(("groups", "slots"), [(PLAIN, 60), (HYBRID, 300)], ids=["plain", "hybrid"])
def test_a_full_pool_deals_a_batchs_blocks_into_runs(groups: list[SimKVGroup], slots: int) -> None:
    """As allocated, a full pool scatters a batch's blocks (an entry takes what its
    victims left: a hybrid's often those of the other bundle); dealt, each bundle's
    blocks of a save sit in a few runs, and a load's slots too (sorted: a load
    lists a bundle's blocks group by group)."""
    before, after = (recorder(slots, groups, dealt=dealt) for dealt in (False, True))
    for keys, prompt, limit in conversations(400, seed=1):
        for rec in (before, after):
            rec.serve(keys, prompt, limit)
    assert after.steady_requests > 300
    for size in {len(g) for g in after.bundles.members}:
        was, now = (r.patterns["save", size].summary() for r in (before, after))
        assert now["blocks_per_batch"] > 10
        assert now["runs_mean"] < min(4, was["runs_mean"] / 3), size
        assert now["in_runs_8"] > 0.5 > 0.1 > was["in_runs_8"], size
        was, now = (r.patterns["load", size].summary() for r in (before, after))
        assert now["sorted_runs_mean"] < min(2, was["sorted_runs_mean"] / 1.4), size


def test_the_recorder_lists_a_batches_slots_as_the_tier_does() -> None:
    """A save: allocation order (position by position, an entry's slots in a row),
    each bundle dealt into the lowest slots in bundle order; a load: group by
    group, each in position order."""
    rec = recorder(1000, HYBRID, steady_only=False, keep=True)
    keys = [f"k{i}".encode() for i in range(6)]
    rec.serve(keys, 6 * BLOCK + 3, 6)
    rec.serve(keys, 6 * BLOCK + 3, 6)  # a repeat: loads every block
    assert rec.kept is not None
    (k1, save), (k2, load) = rec.kept  # (the repeat saves nothing new)
    assert (k1, k2) == ("save", "load")
    assert save[2] == list(range(12))  # 6 positions, a bundle of 2 each
    windows = len(save[3]) // 3  # at the last positions (a hit at the prompt's end)
    assert windows == WINDOW // BLOCK and save[3] == list(range(12, 12 + 3 * windows))
    listed = []  # position by position, as allocated
    for k in range(6):
        listed += save[2][2 * k : 2 * k + 2]
        if k >= 6 - windows:
            listed += save[3][3 * (k - 6 + windows) : 3 * (k - 5 + windows)]
    assert save[ALL] == listed
    assert load[2] == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]  # member 0's, then member 1's
    window_starts = load[3][: len(load[3]) // 3]
    assert load[3] == [s + i for i in range(3) for s in window_starts]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slot_patterns_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_replay_is_kvc_simulates(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark's keys and replay are the simulator's: ``--check`` runs ``kvc
    simulate --exact`` on the same trace and pool and compares hits and evictions."""
    bench = _bench()
    argv = [
        "--trace",
        str(SLICE),
        "--requests",
        "120",
        "--block-size",
        "32",
        "--pools",
        "0.25",
        "--models",
        "plain,hybrid",
        "--check",
    ]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(": the same") == 1 and "DIFFERENT" not in out
    assert "| save | 1 |" in out and "| load | 3 |" in out and "| save | all |" in out


def test_the_tiers_index_and_the_recorders_number_slots_alike() -> None:
    """The recorder drives the tier's own index class (slot numbering, allocation)."""
    assert issubclass(type(recorder(10, PLAIN).index), BlockIndex)
    assert OffloadCPUModel.index_type is not SlotRecorder.index_type
