"""Whether a worker's pool fits in memory, asked before the pool is allocated.

The pool is mapped in full soon after it is allocated (pinned at once, or by the
prefault thread), so a pool larger than the memory left is an OOM kill minutes
into serving. Checked at node start instead, it is an error that says so. The
memory is the core's reading (:func:`composer.available_memory`), looked up here
at each call so that tests can stand in for it.
"""

from __future__ import annotations

from pydantic import ByteSize

from composer import available_memory


def check_pool_fits(node_id: str, capacity: int, pool_bytes: int) -> None:
    """Raise ``ValueError`` naming the node, its capacity and the memory when the
    pool of ``pool_bytes`` does not fit in the memory available now."""
    available, total = available_memory()
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
