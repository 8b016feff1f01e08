"""The data path on every device this machine has: vLLM's KV cache on the CPU, and
on a GPU where there is one (the pool then pinned host memory, copies on a side
stream). The same checks either way; on a GPU machine they are the GPU checks.

Run on a GPU machine as ``pytest plugins/offload-cpu/tests/test_offload_cpu_devices.py``
(without vLLM there, the tests' KV cache config is built without it).
"""

from __future__ import annotations

import pytest
import torch
from kvc_offload_cpu.datapath import HostPool, RegionPlan
from offload_cpu_fakes import Engine, content, corrupt, prompt

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["block", "layer"])
@pytest.mark.parametrize("save_mode", ["sync", "async"])
@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_round_trip_on_the_device(device: str, layout: str, save_mode: str, load_mode: str) -> None:
    eng = Engine(
        num_blocks=256,
        layout=layout,
        device=device,
        save_mode=save_mode,
        load_mode=load_mode,
        events=False,
    )
    assert eng.worker.pool is not None
    assert eng.worker.pool.pools[0].is_pinned() == (device == "cuda")
    p = prompt(1, 100)
    eng.add("a", p)
    eng.prefill("a")
    saved = [_cpu(eng.block_bytes("a", b)) for b in range(3)]
    eng.finish("a")
    eng.settle(4)
    assert len(eng.index) == 3
    ext, is_async = eng.add("b", p)
    assert (ext, is_async) == (96, load_mode == "async")
    if is_async:
        eng.step()
        eng.worker.drain()
        eng.step()
        assert "b" in eng.finished_recving
        ids = eng.running["b"].block_ids
        got = [_cpu(eng.region[ids[b]]) for b in range(3)]
    else:
        eng.prefill("b", forward=False)  # only the load writes the blocks
        got = [_cpu(eng.block_bytes("b", b)) for b in range(3)]
    assert all(torch.equal(g, s) for g, s in zip(got, saved, strict=True))
    assert all(torch.equal(g, content(p, b)) for b, g in enumerate(got))
    assert not eng.errors


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupt_slot_is_refused_on_the_device(device: str) -> None:
    eng = Engine(num_blocks=256, device=device, save_mode="sync", checksums=True, events=False)
    p = prompt(5, 100)
    eng.add("a", p)
    eng.prefill("a")
    eng.finish("a")
    eng.settle(4)
    entry = next(e for e in eng.index.entries() if e.ready)
    corrupt(eng.worker.pool, entry.slots[0], 7)
    eng.add("b", p)
    eng.prefill("b", forward=False)
    assert len(eng.errors) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_has_read_its_slots_when_it_returns(device: str) -> None:
    """The scheduler hands a load's slots to the next save as soon as the load is
    reported: the slots are overwritten right after the load, then the blocks
    compared. (On an H200 with 2 MiB blocks, a copy left in flight read the new
    bytes, before loads waited for their copy.)"""
    width, batch = (2 << 20, 64) if device == "cuda" else (64 << 10, 16)
    g = torch.Generator().manual_seed(3)
    region = torch.randint(-128, 128, (4 * batch, width), generator=g, dtype=torch.int8)
    region = region.to(device)
    pool = HostPool([RegionPlan(frozenset({0}), region, 0, width)], batch, pin=device == "cuda")
    ids, dst, slots = list(range(batch)), list(range(batch, 2 * batch)), list(range(batch))
    pool.save(slots, ids, [0] * batch, with_checksums=False)
    ok, _ = pool.load(slots, dst, [0] * batch, verify=False)
    assert all(ok)
    pool.pools[0].fill_(-1)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(_cpu(region[batch : 2 * batch]), _cpu(region[:batch]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_sleep_mode_keeps_the_pool_and_lets_go_of_vllms_memory(device: str, save_mode: str) -> None:
    """vLLM's sleep mode (0.33+): ``unregister_kv_caches``, vLLM's KV memory released
    and its contents lost, ``restore_kv_caches`` on wake-up. A save still in flight
    finishes first; while asleep the pool holds no view of vLLM's memory (a copy
    raises); after wake-up what the pool held loads back bit-exact."""
    eng = Engine(num_blocks=256, device=device, save_mode=save_mode, events=False)
    pool = eng.worker.pool
    assert pool is not None
    p = prompt(2, 100)
    eng.add("a", p)
    eng.prefill("a")  # an async save is now queued on the worker's thread
    saved = [_cpu(eng.block_bytes("a", b)) for b in range(3)]
    eng.finish("a")

    eng.worker.unregister_kv_caches()
    assert all(f.done() for f, _ in eng.worker._futures)
    assert all(plan.region.device.type == "meta" for plan in pool.plans)
    with pytest.raises((RuntimeError, NotImplementedError, ValueError, IndexError)):
        pool.save([0], [1], [0], with_checksums=False)
    eng.caches.regions[0].tensor.fill_(-7)  # vLLM's KV memory, remapped: its bytes are gone

    eng.worker.restore_kv_caches(eng.caches)
    assert [plan.region.data_ptr() for plan in pool.plans] == [
        r.tensor.data_ptr() for r in eng.caches.regions
    ]
    eng.settle(4)
    assert len(eng.index) == 3
    ext, _ = eng.add("b", p)
    assert ext == 96
    eng.prefill("b", forward=False)  # only the load writes the blocks
    got = [_cpu(eng.block_bytes("b", b)) for b in range(3)]
    assert all(torch.equal(g, s) for g, s in zip(got, saved, strict=True))
    assert not eng.errors


def test_a_restore_in_another_shape_is_refused() -> None:
    eng = Engine(num_blocks=64, events=False)
    assert eng.worker.pool is not None
    eng.worker.unregister_kv_caches()
    other = Engine(num_blocks=64, layout="layer", events=False)
    with pytest.raises(ValueError, match="KV cache region"):
        eng.worker.restore_kv_caches(other.caches)
