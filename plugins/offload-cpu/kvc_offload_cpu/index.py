"""The scheduler half's index: block key -> slot of the host pool, eviction, pins.

The index never touches bytes. A slot's *generation* grows every time the slot
is given to a new key, so a worker can tell a slot that was overwritten from
the one a load was planned against. Which ready block goes first when the pool
is full is the eviction policy's: :class:`Lru` (least recently used) or
:class:`Arc` (adaptive replacement: blocks seen once and blocks seen again in
two lists, sized by which one's evicted blocks come back; the policy vLLM's
offloading connector offers as ``arc``). A pinned block is never a victim.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal

Eviction = Literal["lru", "arc"]


class Entry:
    __slots__ = ("key", "slot", "gen", "ready", "pins", "dropped", "event")

    def __init__(self, key: bytes, slot: int, gen: int) -> None:
        self.key = key
        self.slot = slot
        self.gen = gen
        #: False while the save is in flight: not a hit until every worker confirms it.
        self.ready = False
        #: Pending loads reading this slot; a pinned slot is never evicted or reused.
        self.pins = 0
        #: Removed from the index while pinned; the slot is freed at the last unpin.
        self.dropped = False
        #: The scheduler's KV cache event state for this block (None: none).
        self.event: Any = None

    def __repr__(self) -> str:
        state = "ready" if self.ready else "saving"
        return f"Entry(slot={self.slot}, gen={self.gen}, {state}, pins={self.pins})"


class Lru:
    """Ready entries, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self._order: OrderedDict[bytes, Entry] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def add(self, entry: Entry) -> None:
        self._order[entry.key] = entry
        self._order.move_to_end(entry.key)

    def touch(self, entry: Entry) -> None:
        self._order.move_to_end(entry.key)

    def victims(self) -> Iterator[Entry]:
        return iter(self._order.values())

    def evicted(self, entry: Entry) -> None:
        del self._order[entry.key]

    def discard(self, key: bytes) -> None:
        self._order.pop(key, None)


class Arc:
    """Adaptive replacement (Megiddo and Modha): ``t1`` holds blocks seen once,
    ``t2`` blocks seen again; ``b1``/``b2`` remember the keys evicted from each.
    A block saved again after its eviction from ``t1`` grows ``t1``'s target
    share ``p`` (recency was evicted too soon); after its eviction from ``t2``,
    shrinks it. Victims come from ``t1`` while it holds more than ``p``."""

    def __init__(self, num_slots: int) -> None:
        self.capacity = num_slots
        self.p = 0
        self.t1: OrderedDict[bytes, Entry] = OrderedDict()
        self.t2: OrderedDict[bytes, Entry] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.t1 or key in self.t2

    def add(self, entry: Entry) -> None:
        key = entry.key
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = entry
        elif key in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = entry
        else:
            self.t1[key] = entry
        # The ghost lists remember at most a pool's worth of keys each.
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t2) + len(self.b2) > 2 * self.capacity:
            self.b2.popitem(last=False)

    def touch(self, entry: Entry) -> None:
        key = entry.key
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = entry
        elif key in self.t2:
            self.t2.move_to_end(key)

    def victims(self) -> Iterator[Entry]:
        first, then = (
            (self.t1, self.t2) if len(self.t1) > self.p or not self.t2 else (self.t2, self.t1)
        )
        yield from list(first.values())
        yield from list(then.values())

    def evicted(self, entry: Entry) -> None:
        key = entry.key
        if self.t1.pop(key, None) is not None:
            self.b1[key] = None
        elif self.t2.pop(key, None) is not None:
            self.b2[key] = None

    def discard(self, key: bytes) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)


POLICIES: dict[str, type[Lru] | type[Arc]] = {"lru": Lru, "arc": Arc}


class BlockIndex:
    """Maps block keys to slots of a pool of ``num_slots`` blocks."""

    def __init__(self, num_slots: int, eviction: Eviction = "lru") -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._entries: dict[bytes, Entry] = {}
        #: Ready entries, in the eviction policy's order.
        self._order = POLICIES[eviction](num_slots)
        #: Free slots, lowest first (consecutive saves get consecutive slots).
        self._free: list[int] = list(range(num_slots))
        self._gen: list[int] = [0] * num_slots
        self._by_slot: list[Entry | None] = [None] * num_slots
        self.evictions = 0
        #: Called with every entry that leaves the index (evicted, dropped, reset).
        self.on_remove: Callable[[Entry], None] | None = None

    # -- queries ------------------------------------------------------------ #

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def entries(self) -> list[Entry]:
        """Every indexed entry (ready or being saved)."""
        return list(self._entries.values())

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def ready(self, key: bytes) -> Entry | None:
        """The entry for ``key`` if it can be served now (saved and confirmed)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.ready else None

    def current(self, slot: int, gen: int) -> Entry | None:
        """The live entry holding ``slot`` at generation ``gen``, if any."""
        if not 0 <= slot < self.num_slots or self._gen[slot] != gen:
            return None
        entry = self._by_slot[slot]
        return entry if entry is not None and not entry.dropped else None

    # -- updates ------------------------------------------------------------ #

    def touch(self, entry: Entry) -> None:
        if entry.ready and entry.key in self._order:
            self._order.touch(entry)

    def allocate(self, key: bytes) -> Entry | None:
        """A slot for a new block (evicting the LRU unpinned one if full), or None."""
        if key in self._entries:
            raise KeyError(f"key already indexed: {key.hex()}")
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = next((e for e in self._order.victims() if e.pins == 0), None)
            if victim is None:
                return None
            self._order.evicted(victim)
            self._remove(victim)
            self.evictions += 1
            slot = victim.slot
        self._gen[slot] += 1
        entry = Entry(key, slot, self._gen[slot])
        self._entries[key] = entry
        self._by_slot[slot] = entry
        return entry

    def mark_ready(self, entry: Entry) -> None:
        if entry.dropped or self._entries.get(entry.key) is not entry:
            return
        entry.ready = True
        self._order.add(entry)

    def drop(self, entry: Entry) -> None:
        """Forget ``entry`` (failed save, corrupt data); its slot is freed once unpinned."""
        if self._entries.get(entry.key) is not entry:
            return
        if entry.pins:
            del self._entries[entry.key]
            self._order.discard(entry.key)
            entry.dropped = True
            if self.on_remove is not None:
                self.on_remove(entry)
        else:
            self._remove(entry)
            self._by_slot[entry.slot] = None
            heapq.heappush(self._free, entry.slot)

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, entry
        if entry.pins == 0 and entry.dropped:
            entry.dropped = False  # freed once
            if self._by_slot[entry.slot] is entry:
                self._by_slot[entry.slot] = None
            heapq.heappush(self._free, entry.slot)

    def reset(self) -> int:
        """Drop every ready, unpinned entry (``reset_cache``); returns how many."""
        victims = [e for e in self._order.victims() if e.pins == 0]
        for entry in victims:
            self.drop(entry)
        return len(victims)

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._order.discard(entry.key)
        if self.on_remove is not None:
            self.on_remove(entry)
