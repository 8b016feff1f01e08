"""The data path: whole KV blocks between vLLM's cache and a preallocated host pool.

Every copy is one batched tensor op per canonical region (a gather or a
scatter of many blocks), never a Python loop over blocks or layers. Two details
make it fast on CPU:

* rows are viewed as the widest integer dtype that divides them: torch's
  ``index_copy_`` on int8 rows is ~10x slower than on int64 rows;
* saves into a run of consecutive slots gather straight into the pool
  (``index_select(..., out=pool[s:s+n])``), one pass instead of two; the index
  hands out free slots lowest first, so batches mostly land in a few runs;
  loads from one run read the pool in place (no gather).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

#: Above this many runs of consecutive slots, a batch is copied with one scatter.
MAX_RUNS = 8


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` (int8 rows) viewed as the widest integer dtype its layout allows."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size:
            continue
        try:
            return t.view(dtype)
        except RuntimeError:
            continue
    return t


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: (first index, end index, first slot)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            out.append((start, i, slots[start]))
            start = i
    return out


def checksum(rows: torch.Tensor) -> torch.Tensor:
    """One int64 per row: the wrapping sum of its 8-byte words (any single-word change shows)."""
    return wide(rows).sum(dim=1, dtype=torch.int64)


@dataclass(frozen=True)
class RegionPlan:
    """Where one canonical region's row lives inside a pool slot."""

    group: int
    region: torch.Tensor  # int8 [num_blocks, width], maybe on a device
    offset: int
    width: int


class HostPool:
    """``num_slots`` slots of ``slot_bytes`` in host memory, plus per-slot checksums.

    A slot is logical: the pool keeps one contiguous ``[num_slots, width]``
    tensor per canonical region, so every region's gather lands in contiguous
    memory (one pass into a run of slots) whatever the number of regions.
    """

    def __init__(self, plans: list[RegionPlan], num_slots: int, *, pin: bool) -> None:
        self.plans = plans
        self.slot_bytes = sum(p.width for p in plans)
        self.num_slots = num_slots
        self.pools = [
            torch.empty((num_slots, p.width), dtype=torch.int8, pin_memory=pin) for p in plans
        ]
        self.sums = torch.zeros(num_slots, dtype=torch.int64)
        self.device = plans[0].region.device if plans else torch.device("cpu")
        self._stream: Any = None
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            self._stream = torch.cuda.Stream(device=self.device)

    def prefault(self, chunk_bytes: int = 64 << 20) -> float:
        """Write every page of the pool once; returns seconds.

        ``torch.empty`` leaves the pool's pages unmapped, so the first save into
        a slot pays a page fault per 4 KiB (~1 GiB/s instead of >10 GiB/s): a
        2000-token save took ~25 ms instead of ~1.5 ms, CPU time taken from the
        forward running beside it. Must run before any save (it writes zeros).
        """
        t0 = time.perf_counter()
        for pool in self.pools:
            step = max(1, chunk_bytes // max(1, pool.shape[1]))
            for a in range(0, pool.shape[0], step):
                pool[a : a + step].zero_()
        return time.perf_counter() - t0

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.pools)

    def slot(self, slot: int) -> torch.Tensor:
        """A copy of one slot's bytes (all regions, in plan order)."""
        return torch.cat([p[slot] for p in self.pools])

    def corrupt(self, slot: int, offset: int = 0) -> None:
        """Flip bits of one byte of a slot (tests, fault drills)."""
        for pool in self.pools:
            if offset < pool.shape[1]:
                pool[slot, offset] ^= 0x5A
                return
            offset -= pool.shape[1]
        raise IndexError(offset)

    # -- save: vLLM blocks -> slots ----------------------------------------- #

    def save(
        self,
        slots: list[int],
        block_ids: list[list[int]],
        *,
        with_checksums: bool,
        ready_event: Any = None,
    ) -> float:
        """Copy block ``block_ids[g][i]`` of every group into slot ``slots[i]``. Returns seconds."""
        t0 = time.perf_counter()
        slot_t = torch.tensor(slots, dtype=torch.int64)
        slot_runs = runs(slots)
        sums = torch.zeros(len(slots), dtype=torch.int64) if with_checksums else None
        for plan, pool in zip(self.plans, self.pools, strict=True):
            ids = torch.tensor(block_ids[plan.group], dtype=torch.int64)
            if self.device.type != "cpu":
                self._save_from_device(plan, pool, ids, slot_t, ready_event)
            elif len(slot_runs) <= MAX_RUNS:
                for i0, i1, s0 in slot_runs:
                    torch.index_select(plan.region, 0, ids[i0:i1], out=pool[s0 : s0 + i1 - i0])
            else:
                wide(pool).index_copy_(0, slot_t, wide(plan.region).index_select(0, ids))
            if sums is not None:
                if len(slot_runs) == 1:
                    rows = pool[slots[0] : slots[0] + len(slots)]
                else:
                    rows = pool.index_select(0, slot_t)
                sums += checksum(rows)
        if sums is not None:
            self.sums.index_copy_(0, slot_t, sums)
        return time.perf_counter() - t0

    def _save_from_device(
        self, plan: RegionPlan, pool: torch.Tensor, ids: torch.Tensor, slot_t: torch.Tensor,
        ready_event: Any,
    ) -> None:  # pragma: no cover - needs a GPU
        stream = self._stream
        with torch.cuda.stream(stream):
            if ready_event is not None:
                stream.wait_event(ready_event)
            src = plan.region.index_select(0, ids.to(self.device, non_blocking=True))
            staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            staging.copy_(src, non_blocking=True)
        stream.synchronize()
        wide(pool).index_copy_(0, slot_t, wide(staging))

    # -- load: slots -> vLLM blocks ----------------------------------------- #

    def load(
        self,
        slots: list[int],
        block_ids: list[list[int]],
        *,
        verify: bool,
    ) -> tuple[list[bool], float]:
        """Copy slot ``slots[i]`` into block ``block_ids[g][i]`` of every group.

        With ``verify``, blocks whose checksum differs from the one stored at
        save are not copied; returns (ok per block, seconds).
        """
        t0 = time.perf_counter()
        n = len(slots)
        slot_runs = runs(slots)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        contiguous = len(slot_runs) == 1
        rows = [
            pool[slots[0] : slots[0] + n] if contiguous else pool.index_select(0, slot_t)
            for pool in self.pools
        ]
        ok = [True] * n
        id_lists = block_ids
        if verify:
            sums = torch.zeros(n, dtype=torch.int64)
            for r in rows:
                sums += checksum(r)
            good = sums == self.sums.index_select(0, slot_t)
            if not bool(good.all()):
                ok = good.tolist()
                keep = [i for i in range(n) if ok[i]]
                keep_t = torch.tensor(keep, dtype=torch.int64)
                rows = [r.index_select(0, keep_t) for r in rows]
                id_lists = [[ids[i] for i in keep] for ids in block_ids]
        if rows and rows[0].shape[0]:
            # vLLM mostly hands out consecutive block ids: copy those runs as slices
            # (plain memcpy per run) instead of a scatter.
            id_runs = {g: runs(ids) for g, ids in enumerate(id_lists)}
            for plan, src in zip(self.plans, rows, strict=True):
                if self.device.type == "cpu" and len(id_runs[plan.group]) <= MAX_RUNS:
                    dst = wide(plan.region)
                    w_src = wide(src)
                    for i0, i1, b0 in id_runs[plan.group]:
                        dst[b0 : b0 + i1 - i0].copy_(w_src[i0:i1])
                    continue
                ids = torch.tensor(id_lists[plan.group], dtype=torch.int64)
                if self.device.type != "cpu":  # pragma: no cover - needs a GPU
                    src = src.to(self.device, non_blocking=True)
                    ids = ids.to(self.device, non_blocking=True)
                wide(plan.region).index_copy_(0, ids, wide(src))
        return ok, time.perf_counter() - t0
