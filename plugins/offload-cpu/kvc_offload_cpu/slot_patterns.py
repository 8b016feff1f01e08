"""Where the tier puts a request's blocks in the host pool: the slot patterns its copies see.

A copy is fast when a batch's slots form few runs of consecutive slots (one
``index_select`` into the pool or one read in place on CPU, one
``cudaMemcpyAsync`` per run on a GPU); scattered slots cost a gather or a
copy per block. Which slots a batch gets is decided by the index alone, so it
can be measured without a device: :class:`SlotRecorder` is ``kvc simulate``'s
model of the node (:class:`~kvc_offload_cpu.simulate.OffloadCPUModel`, its
rules unchanged) driving the tier's slot-numbering
:class:`~kvc_offload_cpu.index.BlockIndex` instead of the simulator's
:class:`~kvc_offload_cpu.simulate.SlotCount`, and recording per request:

* its save batch: the slots of the entries allocated for it, dealt bundle by
  bundle as the scheduler half deals a request's saves of a step
  (:meth:`~kvc_offload_cpu.slots.NumberedSlots.deal`; here the whole request
  is one step), listed as the scheduler half lists them for the worker:
  position by position, an entry's slots in its bundle's group order;
* its load batch: the slots of the blocks it loads, group by group, each in
  position order (as the scheduler half lists them).

Each batch is split by entry size (1: a plain model's blocks; a hybrid
model's bundles: one slot per group of a layout; with several bundles, also
all of its slots together, as :data:`ALL`) and summed up in a
:class:`Pattern`. Only batches that start on a full pool count (the steady
state), unless asked otherwise. The numbers are the index's: they do not
depend on the machine, the bytes of a slot or the number of regions.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from composer import SimKVGroup, SimRequest
from kvc_offload_cpu.index import BlockIndex, Entry
from kvc_offload_cpu.simulate import OffloadCPUModel

#: A batch being recorded: entry size -> slots, in transfer order.
Batch = dict[int, list[int]]
#: The "entry size" of a batch's slots of every size together, in transfer order.
ALL = 0


def run_lengths(slots: Sequence[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive slots, in order (as ``datapath.runs``)."""
    out: list[int] = []
    n = 0
    prev = -2
    for s in slots:
        if s == prev + 1:
            n += 1
        else:
            if n:
                out.append(n)
            n = 1
        prev = s
    if n:
        out.append(n)
    return out


def _percentile(values: Sequence[int], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


@dataclass
class Pattern:
    """The batches of one kind (saves or loads) of one entry size."""

    batches: int = 0
    blocks: int = 0
    #: Runs of each batch, in transfer order and of its slots sorted.
    runs: array.array[int] = field(default_factory=lambda: array.array("I"))
    sorted_runs: array.array[int] = field(default_factory=lambda: array.array("I"))
    #: Blocks in runs of at least 8 and 32 slots (transfer order).
    in_8: int = 0
    in_32: int = 0
    #: Batches that are one run (transfer order).
    one_run: int = 0

    def add(self, slots: Sequence[int]) -> None:
        lengths = run_lengths(slots)
        self.batches += 1
        self.blocks += len(slots)
        self.runs.append(len(lengths))
        self.sorted_runs.append(len(run_lengths(sorted(slots))))
        self.in_8 += sum(n for n in lengths if n >= 8)
        self.in_32 += sum(n for n in lengths if n >= 32)
        self.one_run += len(lengths) == 1

    def summary(self) -> dict[str, float]:
        """Batches, mean blocks a batch, runs a batch (mean, p50, p90; and of the slots
        sorted), the share of blocks in runs of >= 8 and >= 32 slots, and the share
        of batches that are one run."""
        n = self.batches or 1
        blocks = self.blocks or 1
        return {
            "batches": self.batches,
            "blocks_per_batch": self.blocks / n,
            "runs_mean": sum(self.runs) / n,
            "runs_p50": _percentile(self.runs, 0.5),
            "runs_p90": _percentile(self.runs, 0.9),
            "sorted_runs_mean": sum(self.sorted_runs) / n,
            "in_runs_8": self.in_8 / blocks,
            "in_runs_32": self.in_32 / blocks,
            "one_run": self.one_run / n,
        }


class RecordingIndex(BlockIndex):
    """The tier's index (slots numbered and allocated as the tier's) telling a batch being
    recorded the entries it allocates (``fresh``: their slots are read once the
    batch is dealt) and the slot each touch of a load reads (``loading``: an entry
    of a bundle is touched once per group, in the bundle's group order, so its
    nth touch reads its nth slot)."""

    def _number_slots(self, num_slots: int) -> None:
        super()._number_slots(num_slots)
        self.fresh: list[Entry] | None = None
        self.loading: Batch | None = None
        self._reads: dict[int, int] = {}  # (id of an entry -> its touches this load)

    def allocate(self, key: bytes, tenant: str = "", size: int = 1) -> Entry | None:
        entry = super().allocate(key, tenant, size)
        if entry is not None and self.fresh is not None:
            self.fresh.append(entry)
        return entry

    def touch(self, entry: Entry) -> None:
        super().touch(entry)
        if self.loading is not None:
            i = self._reads.get(id(entry), 0)
            self._reads[id(entry)] = i + 1
            self.loading.setdefault(entry.size, []).append(entry.slots[i])
            self.loading.setdefault(ALL, []).append(entry.slots[i])

    def record_load(self) -> Batch:
        """Record the slots the touches read from now on, into the batch returned."""
        self.loading, self._reads = {}, {}
        return self.loading


class SlotRecorder(OffloadCPUModel):
    """``kvc simulate``'s model of the node on a slot-numbering index, recording each
    request's save and load batch (see the module's docstring). Block by block
    (no ``unit_blocks``): a slot is one vLLM block of one group, as in the tier.

    ``steady_only``: count only batches that start once the pool has evicted (it
    is full from then on). ``keep``: also keep every batch's slots (``kept``), for
    tests; a whole trace's would fill memory. ``dealt``: see :attr:`dealt`."""

    index_type = RecordingIndex
    index: RecordingIndex

    def __init__(
        self,
        config: BaseModel,
        *,
        block_size: int,
        bytes_per_block: int,
        groups: Sequence[SimKVGroup] = (),
        steady_only: bool = True,
        keep: bool = False,
        dealt: bool = True,
    ) -> None:
        super().__init__(
            config, block_size=block_size, bytes_per_block=bytes_per_block, groups=groups
        )
        self.steady_only = steady_only
        #: Whether a save's slots are dealt as the tier deals them (False: as allocated,
        #: the tier before it dealt them; for comparison).
        self.dealt = dealt
        #: ("save" or "load", entry size) -> its batches' pattern.
        self.patterns: dict[tuple[str, int], Pattern] = {}
        #: Every batch recorded, when asked to keep them: (kind, entry size -> slots).
        self.kept: list[tuple[str, Batch]] | None = [] if keep else None
        #: Requests replayed, and those that started on a full pool.
        self.requests = self.steady_requests = 0

    def serve(
        self,
        keys: Sequence[bytes],
        prompt_tokens: int,
        limit: int,
        request: SimRequest | None = None,
    ) -> int:
        """One request as ``kvc simulate`` replays it through this node alone (no vLLM
        prefix cache): looked up from its first block (at most ``limit`` blocks),
        its hit loaded, its blocks saved. Returns the hit, in blocks."""
        self.requests += 1
        self.steady_requests += self.index.evictions > 0
        self.arrive(request or SimRequest())
        hit = self.lookup(keys, 0, limit)
        if hit > 0:
            self.load(keys, 0, hit)
        self.save(keys, prompt_tokens, hit)
        return hit

    def load(self, keys: Sequence[bytes], start: int, hit: int) -> None:
        steady = self.index.evictions > 0
        batch = self.index.record_load()
        try:
            super().load(keys, start, hit)
        finally:
            self.index.loading = None
        self._add("load", batch, steady)

    def save(
        self,
        keys: Sequence[bytes],
        prompt_tokens: int,
        computed: int,
        loaded: Sequence[tuple[int, int]] = (),
    ) -> int:
        steady = self.index.evictions > 0
        fresh = self.index.fresh = []
        try:
            stored = super().save(keys, prompt_tokens, computed, loaded)
        finally:
            self.index.fresh = None
        live = [e for e in fresh if self.index.get(e.key) is e]
        if self.dealt:  # as the scheduler half deals a request's saves of a step
            by_bundle: list[list[Entry]] = [[] for _ in self.bundle_sizes]
            for entry in live:
                by_bundle[entry.key[-1] if self.several else 0].append(entry)
            self.index.deal(by_bundle)
        batch: Batch = {}
        for entry in live:  # (in allocation order, as the scheduler half lists them)
            batch.setdefault(entry.size, []).extend(entry.slots)
            batch.setdefault(ALL, []).extend(entry.slots)
        self._add("save", batch, steady)
        return stored

    def _add(self, kind: str, batch: Batch, steady: bool) -> None:
        if not batch or (self.steady_only and not steady):
            return
        if self.kept is not None:
            self.kept.append((kind, batch))
        for size, slots in batch.items():
            if size == ALL and not self.several:
                continue  # (the same as its one size)
            pattern = self.patterns.get((kind, size))
            if pattern is None:
                pattern = self.patterns[kind, size] = Pattern()
            pattern.add(slots)

    def summaries(self) -> list[dict[str, Any]]:
        """Each (kind, entry size)'s :meth:`Pattern.summary`, saves first, by size."""
        return [
            {"kind": kind, "size": size, **self.patterns[kind, size].summary()}
            for kind, size in sorted(self.patterns, key=lambda k: (k[0] != "save", k[1]))
        ]
