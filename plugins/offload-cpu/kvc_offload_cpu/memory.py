"""Whether a worker's pool fits in memory, asked before the pool is allocated.

The pool is mapped in full soon after it is allocated (pinned at once, or by the
prefault thread), so a pool larger than the memory left is an OOM kill minutes
into serving. Checked at node start instead, it is an error that says so.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ByteSize

#: A container's memory limit: cgroup v2, then v1. Inside a container these are its
#: own; a machine's root cgroup has no memory.max (v2) or an enormous limit (v1).
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def memory() -> tuple[int, int]:
    """(available, total) bytes of memory for this process: the machine's, or its
    container's limit where that is lower.

    Available is what the kernel can hand out without swapping (free memory and
    reclaimable cache): a pool larger than that is killed, or swapped, once it
    is mapped. A container's usage is not subtracted: the cgroup counts page
    cache as used, and that would refuse pools that fit.
    """
    import psutil  # here, not at import: the pool only exists inside vLLM

    machine = psutil.virtual_memory()
    total = min(machine.total, _container_limit() or machine.total)
    return min(machine.available, total), total


def _container_limit() -> int | None:
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None  # "max": no limit
    return None


def check_pool_fits(node_id: str, capacity: int, pool_bytes: int) -> None:
    """Raise ``ValueError`` naming the node, its capacity and the memory when the
    pool of ``pool_bytes`` does not fit in the memory available now."""
    available, total = memory()
    if pool_bytes <= available:
        return
    raise ValueError(
        f'offload-cpu node "{node_id}": capacity {_size(capacity)} ({_size(pool_bytes)} '
        f"of blocks in this worker process) is more than the {_size(available)} of memory "
        f"available on this machine ({_size(total)} in all); lower capacity (each vLLM "
        "worker process holds a pool of its own)"
    )


def _size(n: int) -> str:
    return ByteSize(n).human_readable(decimal=False)
