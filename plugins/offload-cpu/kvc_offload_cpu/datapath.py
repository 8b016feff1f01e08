"""The data path: whole KV blocks between vLLM's cache and a preallocated host pool.

Every copy is one batched tensor op per canonical region (a gather or a
scatter of many blocks), never a Python loop over blocks or layers. Two details
make it fast on CPU:

* rows are viewed as the widest integer dtype that divides them: torch's
  ``index_copy_`` on int8 rows is far slower than on int64 rows (figures: the
  plugin's README);
* saves into a run of consecutive slots gather straight into the pool
  (``index_select(..., out=pool[s:s+n])``), one pass instead of two; the index
  hands out free slots lowest first and deals a step's slots bundle by bundle
  (:mod:`kvc_offload_cpu.slots`), so batches mostly land in a few runs;
  loads from one run read the pool in place (no gather).

The pool's pages are mapped on a background thread, lowest slots first (where
the index allocates), with ``madvise(MADV_POPULATE_WRITE)``: it faults pages
in without changing their contents, so it needs no coordination with copies
and holds no lock a copy could wait on. A save into a slot it has not reached
yet just writes; the kernel faults those pages on demand.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvc_offload_cpu.memory import pool_memory

#: Above this many runs of consecutive slots, a batch is copied with one scatter.
MAX_RUNS = 8
#: Bytes mapped per ``madvise`` call: the kernel holds the address space's lock
#: (shared) for a call, so an ``mmap`` elsewhere in the process waits at most one chunk.
PREFAULT_CHUNK = 8 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PAGE = mmap.PAGESIZE


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


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (``t`` must outlive the view)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def checksums(parts: list[torch.Tensor], seeds: list[int]) -> list[int]:
    """XXH3-64 of row ``i`` of every part (in order), seeded with ``seeds[i]``.

    ``parts`` are contiguous ``[n, width]`` int8 tensors: the regions of ``n``
    slots. The seed is the slot number, so a block (with its checksum) moved to
    another slot fails too. A real hash, not a sum: the wrapping sum of words
    it replaces passed a +1/-1 change in two words and swapped words.
    """
    views = [(_bytes_of(p), int(p.shape[1])) for p in parts]
    out: list[int] = []
    for i, seed in enumerate(seeds):
        h = xxhash.xxh3_64(seed=seed)
        for mv, w in views:
            h.update(mv[i * w : (i + 1) * w])
        out.append(h.intdigest())
    return out


def checksum_gib_s(nbytes: int = 64 << 20, width: int = 64 << 10, reps: int = 5) -> float:
    """Measured checksum throughput on this machine (rows of ``width`` bytes)."""
    rows = torch.randint(-128, 128, (max(1, nbytes // width), width), dtype=torch.int8)
    seeds = list(range(rows.shape[0]))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        checksums([rows], seeds)
        best = min(best, time.perf_counter() - t0)
    return rows.numel() / best / float(1 << 30)


_libc: Any = None


def populate(t: torch.Tensor, start: int, end: int) -> None:
    """Fault in (write-map) bytes ``[start, end)`` of ``t``'s storage without changing them.

    Raises ``OSError`` where the kernel cannot (before Linux 5.14, not Linux).
    Rounded out to whole pages: the pages around a tensor belong to the same
    mapping, and nothing is written.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if end <= start:
        return
    a = (t.data_ptr() + start) // _PAGE * _PAGE
    b = -(-(t.data_ptr() + end) // _PAGE) * _PAGE
    # ctypes drops the GIL for the call: copies on other threads run meanwhile.
    if _libc.madvise(a, b - a, _MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")


@dataclass(frozen=True)
class RegionPlan:
    """Where one canonical region's row lives inside a pool slot."""

    #: The KV cache groups with layers in this region (with vLLM's hybrid
    #: manager every group's blocks come from the same regions).
    groups: frozenset[int]
    region: torch.Tensor  # int8 [num_blocks, width], maybe on a device
    offset: int
    width: int

    def rows(self, groups: list[int]) -> list[int] | None:
        """Indexes of the blocks (of ``groups``) with a row here; None when all are."""
        if all(g in self.groups for g in groups):
            return None
        return [i for i, g in enumerate(groups) if g in self.groups]


class HostPool:
    """``num_slots`` slots of ``slot_bytes`` in host memory, plus per-slot checksums.

    A slot is logical: the pool keeps one contiguous ``[num_slots, width]``
    tensor per canonical region, so every region's gather lands in contiguous
    memory (one pass into a run of slots) whatever the number of regions.
    """

    def __init__(
        self, plans: list[RegionPlan], num_slots: int, *, pin: bool, log: Any = None
    ) -> None:
        """``pin``: page-locked memory (for a GPU's copies); where it cannot be had, the
        pool is pageable, said once on ``log`` (a structlog logger)."""
        self.plans = plans
        self.slot_bytes = sum(p.width for p in plans)
        self.num_slots = num_slots
        shapes = [(num_slots, p.width) for p in plans]
        #: ``pinned``: whether the pool is page-locked (False where pinning was refused).
        self.pools, self.pinned = pool_memory(shapes, pin=pin, log=log)
        #: XXH3-64 per slot, set when a save with checksums completes.
        self.sums = array.array("Q", bytes(8 * num_slots))
        #: Slots below this are mapped: the prefault got there (or the memory is pinned).
        self.faulted_slots = num_slots if self.pinned else 0
        self._prefault_thread: threading.Thread | None = None
        self._prefault_stop = threading.Event()
        self.device = plans[0].region.device if plans else torch.device("cpu")
        self._stream: Any = None
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            self._stream = torch.cuda.Stream(device=self.device)

    # -- sleep mode: vLLM's KV memory away and back -------------------------- #

    def detach(self) -> None:
        """Forget vLLM's KV tensors (vLLM releases their memory while asleep). The
        slots keep their bytes; a copy before :meth:`attach` raises, never touches
        the released memory."""
        self.plans = [
            dataclasses.replace(
                p, region=torch.empty((0, p.width), dtype=torch.int8, device="meta")
            )
            for p in self.plans
        ]

    def attach(self, regions: list[torch.Tensor]) -> None:
        """vLLM's KV tensors again (after its wake-up), one per plan, as laid out before."""
        if len(regions) != len(self.plans):
            raise ValueError(f"{len(regions)} KV cache regions, the pool has {len(self.plans)}")
        for plan, region in zip(self.plans, regions, strict=True):
            if int(region.shape[1]) != plan.width or region.device != self.device:
                raise ValueError(
                    f"a KV cache region came back as {tuple(region.shape)} on {region.device}, "
                    f"the pool's is [*, {plan.width}] on {self.device}"
                )
        self.plans = [
            dataclasses.replace(p, region=r) for p, r in zip(self.plans, regions, strict=True)
        ]

    # -- prefault: map the pool's pages ahead of the saves ------------------- #

    def _populate(self, pool: torch.Tensor, start: int, end: int) -> None:
        """Map bytes ``[start, end)`` of one region's pool (tests replace it to stall it)."""
        populate(pool, start, end)

    def prefault(
        self, chunk_bytes: int = PREFAULT_CHUNK, stop: threading.Event | None = None
    ) -> float:
        """Map every page of the pool, lowest slots first; returns seconds.

        ``torch.empty`` leaves the pool's pages unmapped, so a save into a fresh
        slot pays a page fault per 4 KiB, an order of magnitude slower (the
        plugin's README has the figures), CPU time taken from the forward running
        beside it. Contents are kept, so it may run beside
        saves and loads, which never wait for it: a slot it has not reached is
        faulted by the save that writes it. Raises ``OSError`` where the kernel
        cannot populate (the pages then fault on first use).
        """
        t0 = time.perf_counter()
        step = max(1, chunk_bytes // max(1, self.slot_bytes))
        for a in range(self.faulted_slots, self.num_slots, step):
            if stop is not None and stop.is_set():
                break
            b = min(self.num_slots, a + step)
            for pool in self.pools:
                w = int(pool.shape[1])
                self._populate(pool, a * w, b * w)
            self.faulted_slots = b
        return time.perf_counter() - t0

    def start_prefault(
        self,
        on_done: Callable[[float | None, BaseException | None], None] | None = None,
        *,
        chunk_bytes: int = PREFAULT_CHUNK,
    ) -> threading.Thread:
        """:meth:`prefault` on a daemon thread; ``on_done(seconds, error)`` when it ends."""

        def go() -> None:
            # Niced: the forward beside it matters more than an early mapping.
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            try:
                seconds = self.prefault(chunk_bytes, stop=self._prefault_stop)
            except BaseException as exc:  # only slower first saves; never raised into vLLM
                if on_done is not None:
                    on_done(None, exc)
                return
            if on_done is not None:
                on_done(seconds, None)

        th = threading.Thread(target=go, name="kvc-offload-cpu-prefault", daemon=True)
        self._prefault_thread = th
        th.start()
        return th

    def stop_prefault(self, timeout: float | None = None) -> None:
        """Stop the background prefault after its current chunk (shutdown)."""
        self._prefault_stop.set()
        th = self._prefault_thread
        if th is not None and th is not threading.current_thread():
            th.join(timeout)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.pools)

    def slot(self, slot: int) -> torch.Tensor:
        """A copy of one slot's bytes (all regions, in plan order)."""
        return torch.cat([p[slot] for p in self.pools])

    # -- save: vLLM blocks -> slots ----------------------------------------- #

    def save(
        self,
        slots: list[int],
        block_ids: list[int],
        groups: list[int],
        *,
        with_checksums: bool,
        ready_event: Any = None,
    ) -> float:
        """Copy block ``block_ids[i]`` (of group ``groups[i]``) into slot ``slots[i]``.

        Returns seconds.
        """
        t0 = time.perf_counter()
        slot_runs = runs(slots)
        for plan, pool in zip(self.plans, self.pools, strict=True):
            keep = plan.rows(groups)
            p_slots = slots if keep is None else [slots[i] for i in keep]
            p_ids = block_ids if keep is None else [block_ids[i] for i in keep]
            if not p_slots:
                continue
            ids = torch.tensor(p_ids, dtype=torch.int64)
            slot_t = torch.tensor(p_slots, dtype=torch.int64)
            p_runs = slot_runs if keep is None else runs(p_slots)
            if self.device.type != "cpu":
                self._save_from_device(plan, pool, ids, slot_t, ready_event)
            elif len(p_runs) <= MAX_RUNS:
                for i0, i1, s0 in p_runs:
                    torch.index_select(plan.region, 0, ids[i0:i1], out=pool[s0 : s0 + i1 - i0])
            else:
                wide(pool).index_copy_(0, slot_t, wide(plan.region).index_select(0, ids))
        if with_checksums:
            # Of what landed in the pool, so host memory gone bad after the save shows;
            # read in place per run of slots (no gather).
            if len(slot_runs) <= MAX_RUNS:
                batches = [
                    ([pool[s0 : s0 + i1 - i0] for pool in self.pools], slots[i0:i1])
                    for i0, i1, s0 in slot_runs
                ]
            else:
                slot_t = torch.tensor(slots, dtype=torch.int64)
                batches = [([pool.index_select(0, slot_t) for pool in self.pools], slots)]
            for parts, seeds in batches:
                for s, digest in zip(seeds, checksums(parts, seeds), strict=True):
                    self.sums[s] = digest
        return time.perf_counter() - t0

    def _save_from_device(
        self,
        plan: RegionPlan,
        pool: torch.Tensor,
        ids: torch.Tensor,
        slot_t: torch.Tensor,
        ready_event: Any,
    ) -> None:  # pragma: no cover - needs a GPU
        stream = self._stream
        with torch.cuda.stream(stream):
            if ready_event is not None:
                stream.wait_event(ready_event)
            src = plan.region.index_select(0, ids.to(self.device, non_blocking=True))
            # (Pinned only with the pool: where pinning was refused, it would fail too.)
            staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pinned)
            staging.copy_(src, non_blocking=True)
        stream.synchronize()
        wide(pool).index_copy_(0, slot_t, wide(staging))

    # -- load: slots -> vLLM blocks ----------------------------------------- #

    def load(
        self,
        slots: list[int],
        block_ids: list[int],
        groups: list[int],
        *,
        verify: bool,
    ) -> tuple[list[bool], float]:
        """Copy slot ``slots[i]`` into block ``block_ids[i]`` (of group ``groups[i]``).

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
        if verify:
            stored = self.sums
            ok = [d == stored[s] for s, d in zip(slots, checksums(rows, slots), strict=True)]
            if not all(ok):
                keep = [i for i in range(n) if ok[i]]
                keep_t = torch.tensor(keep, dtype=torch.int64)
                rows = [r.index_select(0, keep_t) for r in rows]
                block_ids = [block_ids[i] for i in keep]
                groups = [groups[i] for i in keep]
        if rows and rows[0].shape[0]:
            for plan, src in zip(self.plans, rows, strict=True):
                keep_rows = plan.rows(groups)
                p_ids = block_ids
                if keep_rows is not None:  # blocks of groups with no layer here
                    if not keep_rows:
                        continue
                    src = src.index_select(0, torch.tensor(keep_rows, dtype=torch.int64))
                    p_ids = [block_ids[i] for i in keep_rows]
                # vLLM mostly hands out consecutive block ids: copy those runs as
                # slices (plain memcpy per run) instead of a scatter.
                id_runs = runs(p_ids)
                if self.device.type == "cpu" and len(id_runs) <= MAX_RUNS:
                    dst = wide(plan.region)
                    w_src = wide(src)
                    for i0, i1, b0 in id_runs:
                        dst[b0 : b0 + i1 - i0].copy_(w_src[i0:i1])
                    continue
                ids = torch.tensor(p_ids, dtype=torch.int64)
                if self.device.type != "cpu":  # pragma: no cover - needs a GPU
                    self._load_to_device(plan, src, ids)
                    continue
                wide(plan.region).index_copy_(0, ids, wide(src))
        return ok, time.perf_counter() - t0

    def _load_to_device(
        self, plan: RegionPlan, src: torch.Tensor, ids: torch.Tensor
    ) -> None:  # pragma: no cover - needs a GPU
        """Host rows into the blocks, on the pool's stream after the work queued on
        the current one. Returns once the copy has read the rows: the scheduler
        hands their slots to the next save as soon as the load is reported, and a
        copy still in flight would read that save's bytes (seen on an H200 with
        2 MiB blocks, when the copy ran on the current stream unwaited)."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dev_src = src.to(self.device, non_blocking=True)
            dev_ids = ids.to(self.device, non_blocking=True)
            wide(plan.region).index_copy_(0, dev_ids, wide(dev_src))
        stream.synchronize()
