"""How much memory a node may still have allocated: the machine's, or its container's.

A host-memory tier (``offload-cpu``'s pool, LMCache's L1) is mapped in full soon
after it is allocated, so one larger than the memory left is an OOM kill minutes
into serving. Nodes ask :func:`available_memory` at start and refuse instead.
"""

from __future__ import annotations

from pathlib import Path

#: A container's memory limit: cgroup v2, then v1. Inside a container these are its
#: own; a machine's root cgroup has no memory.max (v2) or an enormous limit (v1).
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def available_memory() -> tuple[int, int]:
    """(available, total) bytes of memory for this process: the machine's, or its
    container's limit where that is lower.

    Available is what the kernel can hand out without swapping (free memory and
    reclaimable cache). A container's usage is not subtracted: the cgroup counts
    page cache as used, and that would refuse sizes that fit.
    """
    import psutil  # here, not at import: `import composer` stays light (vLLM requires it)

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
