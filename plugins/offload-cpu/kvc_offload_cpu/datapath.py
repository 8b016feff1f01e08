"""The data path: whole KV blocks between vLLM's cache and a preallocated host pool.

Every copy is one batched tensor op per canonical region (a gather or a
scatter of many blocks), never a Python loop over blocks or layers. Two details
make it fast on CPU:

* rows are viewed as the widest integer dtype that divides them: torch's
  ``index_copy_`` on int8 rows is ~10x slower than on int64 rows;
* saves into a run of consecutive slots gather straight into the pool
  (``index_select(..., out=pool[s:s+n])``), one pass instead of two; the index
  hands out free slots lowest first, so batches mostly land in a few runs.
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
    """``num_slots`` slots of ``slot_bytes`` in host memory, plus per-slot checksums."""

    def __init__(self, plans: list[RegionPlan], num_slots: int, *, pin: bool) -> None:
        self.plans = plans
        self.slot_bytes = sum(p.width for p in plans)
        self.num_slots = num_slots
        self.pool = torch.empty((num_slots, self.slot_bytes), dtype=torch.int8, pin_memory=pin)
        self.sums = torch.zeros(num_slots, dtype=torch.int64)
        self.device = plans[0].region.device if plans else torch.device("cpu")
        self._single = len(plans) == 1 and plans[0].width == self.slot_bytes
        self._cols = [self.pool[:, p.offset : p.offset + p.width] for p in plans]
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

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
        for plan, cols in zip(self.plans, self._cols, strict=True):
            ids = torch.tensor(block_ids[plan.group], dtype=torch.int64)
            if self.device.type != "cpu":
                self._save_from_device(plan, cols, ids, slot_t, ready_event)
            elif self._single and len(slot_runs) <= MAX_RUNS:
                for i0, i1, s0 in slot_runs:
                    torch.index_select(plan.region, 0, ids[i0:i1], out=self.pool[s0 : s0 + i1 - i0])
            else:
                wide(cols).index_copy_(0, slot_t, wide(plan.region).index_select(0, ids))
        if with_checksums:
            if len(slot_runs) == 1:
                rows = self.pool[slots[0] : slots[0] + len(slots)]
            else:
                rows = self.pool.index_select(0, slot_t)
            self.sums.index_copy_(0, slot_t, checksum(rows))
        return time.perf_counter() - t0

    def _save_from_device(
        self, plan: RegionPlan, cols: torch.Tensor, ids: torch.Tensor, slot_t: torch.Tensor,
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
        wide(cols).index_copy_(0, slot_t, wide(staging))

    # -- load: slots -> vLLM blocks ----------------------------------------- #

    def load(
        self,
        slots: list[int],
        block_ids: list[list[int]],
        *,
        verify: bool,
    ) -> tuple[list[bool], float]:
        """Copy slot ``slots[i]`` into block ``block_ids[g][i]`` of every group.

        With ``verify``, rows whose checksum differs from the one stored at save
        are not copied; returns (ok per block, seconds).
        """
        t0 = time.perf_counter()
        n = len(slots)
        slot_runs = runs(slots)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        if len(slot_runs) == 1:
            rows = self.pool[slots[0] : slots[0] + n]
        else:
            rows = self.pool.index_select(0, slot_t)
        ok = [True] * n
        id_lists = block_ids
        if verify:
            good = checksum(rows) == self.sums.index_select(0, slot_t)
            if not bool(good.all()):
                ok = good.tolist()
                keep = [i for i in range(n) if ok[i]]
                keep_t = torch.tensor(keep, dtype=torch.int64)
                rows = rows.index_select(0, keep_t)
                id_lists = [[ids[i] for i in keep] for ids in block_ids]
        if rows.shape[0]:
            for plan in self.plans:
                ids = torch.tensor(id_lists[plan.group], dtype=torch.int64)
                src = rows[:, plan.offset : plan.offset + plan.width]
                if self.device.type != "cpu":  # pragma: no cover - needs a GPU
                    src = src.to(self.device, non_blocking=True)
                    ids = ids.to(self.device, non_blocking=True)
                wide(plan.region).index_copy_(0, ids, wide(src))
        return ok, time.perf_counter() - t0
