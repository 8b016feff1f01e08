"""The host pool's slots as the index numbers them, and where a batch's entries go.

:class:`NumberedSlots` is the slot half of :class:`~kvc_offload_cpu.index.BlockIndex`:
which slots are free (a heap, lowest first: a pool filling up hands out
consecutive slots), each slot's generation and the entry holding it.

A copy is fast when a batch's slots form few runs of consecutive slots (one
gather straight into the pool on CPU, one DMA per run on a GPU); where the
slots are is the index's choice alone. Once the pool is full it has almost
none: a new entry takes the slots the eviction policy's victims just left.
With one slot an entry, that is already mostly runs: LRU evicts the blocks
saved together, together. A hybrid model's bundles are not: a request saves
them position by position, interleaved, but they live apart (a hit touches
every full-attention block, a window's only near its end), so an entry of one
size takes the scattered slots a victim of another size left.
:meth:`NumberedSlots.deal` restores the runs without changing one eviction:
a batch's slots hold nothing and are nobody else's until its copies are
planned, so they are dealt again among its entries, bundle by bundle (the
plugin's README has the figures: ``benchmarks/slot_patterns.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvc_offload_cpu.index import Entry


class NumberedSlots:
    """The slots of :class:`~kvc_offload_cpu.index.BlockIndex` (its base): free ones,
    generations, holders; ``_number_slots`` sets them up for ``num_slots``."""

    num_slots: int
    _entries: dict[bytes, Entry]

    def _number_slots(self, num_slots: int) -> None:
        #: Free slots, lowest first (consecutive saves get consecutive slots).
        self._free: list[int] = list(range(num_slots))
        self._gen: list[int] = [0] * num_slots
        self._by_slot: list[Entry | None] = [None] * num_slots

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def current(self, slot: int, gen: int) -> Entry | None:
        """The live entry holding ``slot`` at generation ``gen``, if any."""
        if not 0 <= slot < self.num_slots or self._gen[slot] != gen:
            return None
        entry = self._by_slot[slot]
        return entry if entry is not None and not entry.dropped else None

    def _free_slots(self, entry: Entry) -> None:
        for slot in entry.slots:
            if self._by_slot[slot] is entry:
                self._by_slot[slot] = None
            heapq.heappush(self._free, slot)

    def deal(self, bundles: Sequence[Sequence[Entry]]) -> None:
        """Deal the slots of a batch's entries again: those of ``bundles[0]`` (in their
        order, each entry's slots in a row) first, in the lowest of the batch's
        slots, then ``bundles[1]``'s, and so on.

        The entries must be what one batch just allocated, before any copy was
        planned for them (the scheduler half's saves of a request in a step):
        their slots hold nothing yet and no one else's. Which slots the batch
        holds, which entries and what the eviction policy decided are unchanged;
        only who holds which, at a generation past every one of them. Entries
        that left the index meanwhile (a replay readies a position's entries at
        once, so a small pool may evict them again) are skipped."""
        live = [[e for e in entries if self._entries.get(e.key) is e] for entries in bundles]
        slots = sorted([s for entries in live for e in entries for s in e.slots])
        if not slots:
            return
        gen_of, by_slot = self._gen, self._by_slot
        gen = max([gen_of[s] for s in slots]) + 1
        at = 0
        for entries in live:
            for entry in entries:
                n = len(entry.slots)
                entry.slots, entry.gen = tuple(slots[at : at + n]), gen
                at += n
                for s in entry.slots:
                    gen_of[s] = gen
                    by_slot[s] = entry
