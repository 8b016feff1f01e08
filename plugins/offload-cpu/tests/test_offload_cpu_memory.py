"""A capacity larger than the memory left is an error at node start, not an OOM kill."""

from __future__ import annotations

import pytest
from kvc_offload_cpu import memory as memory_module
from kvc_offload_cpu.config import OffloadCPUConfig
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
