"""A capacity larger than the memory left is an error at node start, not an OOM kill; a
pool that cannot be pinned is pageable, said once, never a failed start."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest
import structlog
import torch
from kvc_offload_cpu import memory as memory_module
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.datapath import HostPool, RegionPlan
from kvc_offload_cpu.worker import WorkerHalf
from offload_cpu_fakes import SLOT, canonical, kv_cache_config
from pydantic import ByteSize

from composer import NodeContext

GiB = 1024**3


def _start_worker(capacity: int) -> WorkerHalf:
    """The worker half of a node "cpu" of ``capacity``, its pool allocated."""
    config = OffloadCPUConfig(capacity=ByteSize(capacity))
    worker = WorkerHalf(
        NodeContext("cpu", config, "both", "worker", kv_cache_config=kv_cache_config(8))
    )
    caches, _ = canonical(8)
    worker.register_kv_caches(caches)
    return worker


def test_a_capacity_past_this_machines_memory_fails_at_start_naming_node_and_sizes() -> None:
    capacity = 2**59  # valid (at most 1 EiB), and more than any machine here holds
    _, total = memory_module.available_memory()
    with pytest.raises(ValueError) as info:
        _start_worker(capacity)
    message = str(info.value)
    assert message.startswith('offload-cpu node "cpu": capacity 512.0PiB (')
    assert f"({ByteSize(total).human_readable(decimal=False)} in all)" in message
    assert "lower capacity" in message


@pytest.mark.parametrize(
    ("available", "fits"),
    [(4 * SLOT, True), (4 * SLOT + 1, True), (4 * SLOT - 1, False), (0, False)],
)
def test_the_pool_must_fit_in_the_memory_available_now(
    monkeypatch: pytest.MonkeyPatch, available: int, fits: bool
) -> None:
    monkeypatch.setattr(memory_module, "available_memory", lambda: (available, 64 * GiB))
    if fits:
        assert _start_worker(4 * SLOT).pool is not None
        return
    with pytest.raises(
        ValueError, match=r"of memory available on this machine \(64\.0GiB in all\)"
    ):
        _start_worker(4 * SLOT)


#: What CUDA says when the locked-memory limit refuses a pinned allocation.
REFUSED = "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"


@pytest.fixture
def unpinnable(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Pinned allocations fail (cudaHostAlloc under a low ``ulimit -l``), on any
    machine; the shapes asked for are listed."""
    empty = torch.empty
    asked: list[tuple[Any, ...]] = []

    def refusing(*shape: Any, **kw: Any) -> torch.Tensor:
        if kw.get("pin_memory"):
            asked.append(shape)
            raise RuntimeError(REFUSED)
        return empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", refusing)
    return asked


def _warnings(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning"]


def test_a_pool_that_cannot_be_pinned_is_pageable_and_says_why_once(
    unpinnable: list[tuple[Any, ...]],
) -> None:
    caches, _ = canonical(8, "per_layer")  # two regions: the pool is two tensors
    plans = []
    for i, region in enumerate(caches.regions):
        plans.append(RegionPlan(frozenset({0}), region.tensor, i, int(region.tensor.shape[1])))
    with structlog.testing.capture_logs() as logs:
        pool = HostPool(plans, 6, pin=True)
    assert unpinnable  # it asked for pinned memory first
    assert not pool.pinned and all(not p.is_pinned() for p in pool.pools)
    assert pool.faulted_slots == 0  # pageable pages are mapped on first touch (or prefault)
    (said,) = _warnings(logs)
    assert "could not be pinned" in said["event"] and "pageable" in said["event"]
    assert said["error"] == " ".join(REFUSED.split())
    assert "half the bandwidth" in said["expect"]
    assert "ulimit -l" in said["fix"] and "memlock" in said["fix"]
    # It works: a save and a load through the pageable pool, and its prefault maps it.
    ids = [3, 5]
    pool.save([0, 1], ids, [0, 0], with_checksums=True)
    before = [r.tensor[ids].clone() for r in caches.regions]
    for r in caches.regions:
        r.tensor[ids] = 0
    ok, _ = pool.load([0, 1], ids, [0, 0], verify=True)
    assert ok == [True, True]
    assert all(torch.equal(r.tensor[ids], b) for r, b in zip(caches.regions, before, strict=True))
    pool.prefault()
    assert pool.faulted_slots == 6


def test_a_pool_asked_unpinned_never_tries_nor_warns(unpinnable: list[tuple[Any, ...]]) -> None:
    caches, _ = canonical(8)
    region = caches.regions[0].tensor
    with structlog.testing.capture_logs() as logs:
        pool = HostPool([RegionPlan(frozenset({0}), region, 0, int(region.shape[1]))], 4, pin=False)
    assert not unpinnable and not pool.pinned and _warnings(logs) == []


def test_a_worker_whose_pool_cannot_be_pinned_starts_pageable_and_prefaults_it(
    monkeypatch: pytest.MonkeyPatch, unpinnable: list[tuple[Any, ...]]
) -> None:
    """A worker that pins its pool (a GPU's) where pinning is refused: one warning
    naming the node, the pool pageable, and the prefault that an unpinned pool gets."""
    monkeypatch.setattr(WorkerHalf, "_pins", staticmethod(lambda device: True))
    with structlog.testing.capture_logs() as logs:
        worker = _start_worker(4 * SLOT)
        pool = worker.pool
        assert pool is not None and unpinnable
        assert pool._prefault_thread is not None  # as for an unpinned pool
        pool._prefault_thread.join(60)
    assert not pool.pinned and pool.faulted_slots == pool.num_slots == 4
    (said,) = _warnings(logs)
    assert said["node"] == "cpu" and "could not be pinned" in said["event"]
    started = [e for e in logs if e["event"] == "offload-cpu worker pool"]
    assert started and started[0]["pinned"] is False
