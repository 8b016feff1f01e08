"""Config, discovery, keys, layout, index and the benchmark of the offload-cpu plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.datapath import HostPool, RegionPlan, runs, wide
from kvc_offload_cpu.index import BlockIndex
from kvc_offload_cpu.keys import chain_hash
from kvc_offload_cpu.layout import layout_from_kv_cache_config
from offload_cpu_fakes import BLOCK, PAGE, SLOT, block_keys, canonical, corrupt, kv_cache_config
from pydantic import ValidationError

from composer import discover, load_pipeline


def test_config_parses_sizes_and_forbids_unknown_keys() -> None:
    c = OffloadCPUConfig(capacity="8GiB")
    assert int(c.capacity) == 8 * 1024**3
    assert (c.save, c.min_blocks, c.load_mode, c.checksums) == (
        "prompt",
        1,
        "sync",
        False,
    )
    with pytest.raises(ValidationError, match="extra"):
        OffloadCPUConfig(capacty="1GiB")
    assert (c.eviction, c.admission, c.store_threshold, c.promote) == (
        "lru",
        "threshold",
        1,
        "on_hit",
    )
    # A policy is a plugin: any name parses here, and validation refuses one that is
    # not installed (tests/test_cache_policies.py).
    assert OffloadCPUConfig(eviction="lfu").eviction == "lfu"
    with pytest.raises(ValidationError):
        OffloadCPUConfig(store_threshold=0)
    with pytest.raises(ValidationError):
        OffloadCPUConfig(promote="always")
    with pytest.raises(ValidationError):
        OffloadCPUConfig(min_blocks=0)
    assert all(f.description for f in OffloadCPUConfig.model_fields.values())


def test_registered_through_the_entry_point_without_torch() -> None:
    ptype = discover()["offload-cpu"]
    assert ptype.class_refs() == {
        "scheduler": "kvc_offload_cpu.scheduler:SchedulerHalf",
        "worker": "kvc_offload_cpu.worker:WorkerHalf",
    }
    assert ptype.processes == {"scheduler", "worker"} and ptype.default_role == "both"
    assert ptype.package == "kv-composer-offload-cpu"
    caps = ptype.resolve_capabilities(OffloadCPUConfig(load_mode="async"))
    assert caps.async_load and caps.async_save and caps.hma
    code = (
        "import sys; from composer import discover; "
        "from composer import load_pipeline; discover()['offload-cpu']; "
        "load_pipeline({'version': 1, 'nodes': {'cpu': {'plugin': 'offload-cpu', "
        "'config': {'capacity': '1GiB'}}}}); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pipeline_validation_points_at_bad_plugin_options() -> None:
    from composer import PipelineInvalid

    with pytest.raises(PipelineInvalid, match="capacity"):
        load_pipeline(
            {
                "version": 1,
                "nodes": {"cpu": {"plugin": "offload-cpu", "config": {"capacity": "lots"}}},
            }
        )
    p = load_pipeline(
        {
            "version": 1,
            "nodes": {
                "cpu": {"plugin": "offload-cpu", "config": {"capacity": "2GiB", "save": "all"}}
            },
        }
    )
    assert p.nodes[0].config.save == "all"


def test_keys_are_chained_deterministic_and_the_same_in_another_process() -> None:
    tokens = list(range(100))
    keys = block_keys(tokens, BLOCK)
    assert len(keys) == 3  # the 4 trailing tokens make no key
    assert block_keys(tokens[:64] + [7] * 36, BLOCK)[:2] == keys[:2]
    assert block_keys([1] + tokens[1:], BLOCK)[2] != keys[2]  # a change anywhere before
    assert keys[1] == chain_hash(keys[0], tokens[32:64])
    # A tenant's (vLLM's cache_salt) keys are its own, as in vLLM's hashes.
    salted = block_keys(tokens, BLOCK, "acme")
    assert not set(salted) & set(keys) and not set(salted) & set(block_keys(tokens, BLOCK, "b"))
    assert block_keys(tokens, BLOCK, "acme") == salted
    code = (
        "from types import SimpleNamespace; from kvc_offload_cpu.keys import RequestKeys; "
        "keys = RequestKeys(None); "
        "keys.ensure(SimpleNamespace(all_token_ids=list(range(100)), tenant=''), 3, 32); "
        "print(keys.keys[2].hex())"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        assert out.stdout.strip() == keys[2].hex()


def test_layout_from_vllm_kv_cache_config_matches_the_canonical_view() -> None:
    layout = layout_from_kv_cache_config(kv_cache_config(16))
    for kind in ("block", "layer"):
        caches, _ = canonical(16, kind)
        assert layout.slot_bytes == caches.bytes_per_block == SLOT
    assert layout.block_size == BLOCK and layout.num_groups == 1
    assert layout.group_kinds == ("attention",)
    assert SLOT == 2 * PAGE


def test_index_lru_pins_and_generations() -> None:
    idx = BlockIndex(2)
    a = idx.allocate(b"a")
    assert a is not None and idx.ready(b"a") is None  # saving: not a hit
    idx.mark_ready(a)
    b = idx.allocate(b"b")
    assert b is not None
    idx.mark_ready(b)
    idx.pin(a)
    c = idx.allocate(b"c")  # a is pinned: b goes
    assert c is not None and c.slots == b.slots and c.gen == b.gen + 1
    assert b"b" not in idx and idx.evictions == 1
    assert idx.allocate(b"d") is None  # a pinned, c still saving
    idx.drop(a)  # dropped while pinned: slot stays taken until unpinned
    assert b"a" not in idx and idx.used_slots == 2
    idx.unpin(a)
    assert idx.used_slots == 1
    (slot,), gen = c.slots, c.gen
    assert idx.current(slot, gen) is c and idx.current(slot, gen - 1) is None


def test_an_entry_of_several_slots_takes_free_ones_then_evicts_whole_entries() -> None:
    """A hybrid's bundle: one entry, one slot per group; it goes whole, and what a
    victim leaves over is free."""
    idx = BlockIndex(5)
    a = idx.allocate(b"a", size=3)
    assert a is not None and len(set(a.slots)) == 3 and idx.used_slots == 3
    idx.mark_ready(a)
    b = idx.allocate(b"b")
    assert b is not None
    idx.mark_ready(b)
    c = idx.allocate(b"c", size=2)  # one free slot: the oldest entry goes, all 3 slots
    assert c is not None and b"a" not in idx and idx.evictions == 3 and idx.used_slots == 3
    assert all(idx.current(s, a.gen) is None for s in a.slots)
    assert all(idx.current(s, c.gen) is c for s in c.slots)
    idx.mark_ready(c)
    idx.pin(b)
    idx.pin(c)
    assert idx.allocate(b"d", size=3) is None  # 2 free, the rest pinned: nothing lost
    assert len(idx) == 2 and idx.used_slots == 3 and idx.evictions == 3
    assert idx.allocate(b"e", size=6) is None and len(idx) == 2  # more than the pool
    d = idx.allocate(b"d", size=2)
    assert d is not None and idx.used_slots == 5
    idx.drop(c)  # dropped while pinned: both its slots stay taken until unpinned
    assert idx.used_slots == 5
    idx.unpin(c)
    assert idx.used_slots == 3 and idx.current(c.slots[1], c.gen) is None


def test_a_quota_counts_an_entrys_slots() -> None:
    idx = BlockIndex(6, quotas={"t": 0.5})  # t: 3 slots
    assert idx.quotas is not None
    first = idx.allocate(b"x", "t", size=2)
    assert first is not None
    idx.mark_ready(first)
    other = idx.allocate(b"o", "u", size=2)  # (others: the rest)
    assert other is not None
    idx.mark_ready(other)
    assert idx.quotas.held["t"] == 2
    # t holds 2 of its 3 and needs 2: with 2 slots free, free slots are anyone's
    second = idx.allocate(b"y", "t", size=2)
    assert second is not None and idx.quotas.held["t"] == 4
    idx.mark_ready(second)
    # Full, t past its share: t's own oldest entry goes, not the other tenant's.
    third = idx.allocate(b"z", "t", size=2)
    assert third is not None and b"x" not in idx and b"o" in idx
    assert idx.quotas.held["t"] == 4 and idx.quotas.evicted["t"] == 2


def test_data_path_helpers() -> None:
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 5, 9), (5, 6, 2)]
    assert wide(torch.zeros(4, 16, dtype=torch.int8)).dtype == torch.int64
    assert wide(torch.zeros(4, 6, dtype=torch.int8)).dtype == torch.int16
    assert wide(torch.zeros(4, 16, dtype=torch.int8)[:, 1:9]).dtype == torch.int8


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [5, 1, 7, 3], list(range(0, 40, 2))])
@pytest.mark.parametrize("kind", ["block", "layer"])
@pytest.mark.parametrize("blocks", ["run", "scattered"])
def test_host_pool_round_trip(slots: list[int], kind: str, blocks: str) -> None:
    caches, _ = canonical(64, kind)
    plans, off = [], 0
    for rid in caches.groups[0].region_ids:
        t = caches.regions[rid].tensor
        plans.append(RegionPlan(frozenset({0}), t, off, t.shape[1]))
        off += t.shape[1]
    for r in caches.regions:
        r.tensor.copy_(torch.randint(-128, 128, r.tensor.shape, dtype=torch.int8))
    pool = HostPool(plans, 48, pin=False)
    before = [p.clone() for p in pool.pools]
    assert pool.prefault() >= 0 and pool.faulted_slots == 48
    assert all(torch.equal(a, b) for a, b in zip(before, pool.pools, strict=True))  # kept
    src = list(range(10, 10 + len(slots)))
    expect = torch.cat([r.tensor[src] for r in caches.regions], dim=1)
    pool.save(slots, src, [0] * len(slots), with_checksums=True)
    # Consecutive block ids (slice copies, wrapping into 2 runs for 20 blocks) or
    # one run per block (> MAX_RUNS: one scatter).
    dst = [d % 64 for d in range(50, 50 + len(slots))]
    if blocks == "scattered":
        dst = [(63 - 3 * i) % 64 for i in range(len(slots))]
    ok, _ = pool.load(slots, dst, [0] * len(slots), verify=True)
    assert all(ok)
    got = torch.cat([r.tensor[dst] for r in caches.regions], dim=1)
    assert torch.equal(got, expect)
    corrupt(pool, slots[-1], SLOT - 1)
    ok, _ = pool.load(slots, dst, [0] * len(slots), verify=True)
    assert ok == [True] * (len(slots) - 1) + [False]
