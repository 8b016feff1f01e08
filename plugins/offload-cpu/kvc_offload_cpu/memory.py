"""The pool's memory: whether it fits, asked before it is allocated, and its allocation.

The pool is mapped in full soon after it is allocated (pinned at once, or by the
prefault thread), so a pool larger than the memory left is an OOM kill minutes
into serving. Checked at node start instead, it is an error that says so. The
memory is the core's reading (:func:`composer.available_memory`), looked up here
at each call so that tests can stand in for it.

A pool for a GPU's copies is pinned (page-locked) where the system allows it.
Where it does not (a low ``ulimit -l``, a container's memlock limit: CUDA's
``cudaHostAlloc`` fails), the pool is pageable instead: slower copies, said
once on the log with why and what to do, never a node that fails to start.
"""

from __future__ import annotations

import contextlib
from typing import Any

import structlog
import torch
from pydantic import ByteSize

from composer import available_memory

#: Where a pool says it could not be pinned, unless given a logger (the worker's).
_log = structlog.get_logger("kv_composer")


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


def pool_memory(
    shapes: list[tuple[int, int]], *, pin: bool, log: Any = None
) -> tuple[list[torch.Tensor], bool]:
    """An uninitialized int8 tensor of each shape, and whether they are pinned: when
    ``pin`` and the system allows it; else pageable, said once on ``log`` (a
    structlog logger; default: the ``kv_composer`` one)."""
    if pin:
        try:
            return _tensors(shapes, pin=True), True
        except Exception as exc:  # cudaHostAlloc refused: a low `ulimit -l`, a container
            # What was pinned before the refusal goes back to the system, not to torch's
            # cache of pinned blocks: the pageable pool needs the memory.
            with contextlib.suppress(Exception):
                torch.accelerator.empty_host_cache()
            nbytes = sum(rows * width for rows, width in shapes)
            (log or _log).warning(
                "offload-cpu: the host pool could not be pinned; it uses pageable memory",
                error=" ".join(str(exc).split()) or type(exc).__name__,
                pool=_size(nbytes),
                expect=(
                    "copies between the GPU and the pool go through pageable memory: about "
                    "half the bandwidth of pinned memory or less, so saves and loads take "
                    "about twice as long"
                ),
                fix=(
                    f"raise the locked-memory limit above {_size(nbytes)} (ulimit -l; in a "
                    "container its memlock ulimit, e.g. docker run --ulimit memlock=-1)"
                ),
            )
    return _tensors(shapes, pin=False), False


def _tensors(shapes: list[tuple[int, int]], *, pin: bool) -> list[torch.Tensor]:
    # torch.empty maps no page yet (pinned memory is mapped and locked here).
    return [torch.empty(shape, dtype=torch.int8, pin_memory=pin) for shape in shapes]


def _size(n: int) -> str:
    return ByteSize(n).human_readable(decimal=False)
