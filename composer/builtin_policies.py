"""The built-in cache policies, on the specs of :mod:`composer.policy`: ``lru`` and ``arc``
(eviction), ``threshold`` (admission) and ``request`` (retention).
:mod:`composer.builtin` registers them.

What each costs does not grow with the pool: every method is O(1) (``threshold``:
O(1) per key, amortized), and ``victims()`` is a lazy walk of the policy's own
ordered dicts, which the tier stops at the first block it may evict
(``tests/test_policy_scale.py`` counts the work at two pool sizes). The one
exception is ``request``'s ``yields``, O(blocks kept): the tier asks it only when
every block it could evict is kept."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from composer.controls import Retention
from composer.policy import AdmissionPolicy, Block, CachePolicy, EvictionPolicy, RetentionPolicy


class Lru(EvictionPolicy):
    """The least recently used block goes first. Every method is O(1): one ordered dict,
    walked in place by ``victims()`` (the tier stops at the first block it may evict)."""

    def __init__(self, slots: int, config: Any = None) -> None:
        super().__init__(slots, config)
        self.order: OrderedDict[bytes, Block] = OrderedDict()

    def added(self, block: Block) -> None:
        self.order[block.key] = block
        self.order.move_to_end(block.key)

    def touched(self, block: Block) -> None:
        self.order.move_to_end(block.key)

    def passed_over(self, block: Block) -> None:
        # A kept block ages from its last pass, so the next eviction starts past it.
        self.order.move_to_end(block.key)

    def victims(self) -> Iterator[Block]:
        return iter(self.order.values())

    def removed(self, block: Block, evicted: bool) -> None:
        self.order.pop(block.key, None)


class Arc(EvictionPolicy):
    """Adaptive replacement (Megiddo and Modha), the policy vLLM's offloading connector
    offers as ``arc``: ``t1`` holds blocks seen once, ``t2`` blocks seen again;
    ``b1``/``b2`` remember the keys evicted from each. A block saved again after
    its eviction from ``t1`` grows ``t1``'s target share ``p`` (recency was
    evicted too soon); after its eviction from ``t2``, shrinks it. Victims come
    from ``t1`` while it holds more than ``p``. Every list is measured in the
    tier's slots (a block's ``size``), as ``p`` and the pool are."""

    def __init__(self, slots: int, config: Any = None) -> None:
        super().__init__(slots, config)
        self.p = 0
        self.t1: OrderedDict[bytes, Block] = OrderedDict()
        self.t2: OrderedDict[bytes, Block] = OrderedDict()
        #: Evicted keys, and the slots each took.
        self.b1: OrderedDict[bytes, int] = OrderedDict()
        self.b2: OrderedDict[bytes, int] = OrderedDict()
        #: Slots of each list's blocks.
        self.n1 = self.n2 = self.g1 = self.g2 = 0

    def added(self, block: Block) -> None:
        key, size, capacity = block.key, block.size, self.slots
        if key in self.b1:
            self.p = min(capacity, self.p + size * max(1, self.g2 // max(1, self.g1)))
            self.g1 -= self.b1.pop(key)
            self.t2[key] = block
            self.n2 += size
        elif key in self.b2:
            self.p = max(0, self.p - size * max(1, self.g1 // max(1, self.g2)))
            self.g2 -= self.b2.pop(key)
            self.t2[key] = block
            self.n2 += size
        else:
            self.t1[key] = block
            self.n1 += size
        # The ghost lists remember at most a pool's worth of keys each.
        while self.b1 and self.n1 + self.g1 > capacity:
            self.g1 -= self.b1.popitem(last=False)[1]
        while self.b2 and self.n2 + self.g2 > 2 * capacity:
            self.g2 -= self.b2.popitem(last=False)[1]

    def touched(self, block: Block) -> None:
        key = block.key
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = block
            self.n1 -= block.size
            self.n2 += block.size
        elif key in self.t2:
            self.t2.move_to_end(key)

    def passed_over(self, block: Block) -> None:
        # As a use: to t2's back. Kept where it was, a block in the list walked first
        # would be walked again at every eviction (t1 all kept: O(t1) each); and a
        # block the requests ask the tier to keep is one they use again.
        self.touched(block)

    def victims(self) -> Iterator[Block]:
        """The list over its target first, then the other, each oldest first.

        Lazy, and O(1) to start: the tier takes the first block it may evict and
        drops the iterator before it tells the policy anything (``removed``: the
        contract of ``offload-cpu``'s ``BlockIndex._victim``), so the lists are
        walked in place, never copied (a copy costs the pool's size at every
        eviction)."""
        first, then = (
            (self.t1, self.t2) if self.n1 > self.p or not self.t2 else (self.t2, self.t1)
        )
        yield from first.values()
        yield from then.values()

    def removed(self, block: Block, evicted: bool) -> None:
        key, size = block.key, block.size
        if self.t1.pop(key, None) is not None:
            self.n1 -= size
            if evicted:
                self.b1[key] = size
                self.g1 += size
        elif self.t2.pop(key, None) is not None:
            self.n2 -= size
            if evicted:
                self.b2[key] = size
                self.g2 += size


class Threshold(AdmissionPolicy):
    """A block takes room once ``store_threshold`` requests have contained it (1: on first
    sight), as vLLM's OffloadingConnector's ``store_threshold``; counts are kept for
    the last 4 x slots blocks seen. A request's blocks are saved up to the first one
    not yet seen often enough (a later block extends a prefix that is not kept)."""

    def __init__(self, slots: int, config: Any = None) -> None:
        super().__init__(slots, config)
        self.threshold = int(getattr(config, "store_threshold", 1) or 1)
        #: Block key -> requests that contained it, least recently seen first.
        self.seen: OrderedDict[bytes, int] = OrderedDict()

    def admit(self, keys: Sequence[bytes]) -> int:
        if self.threshold <= 1:
            return len(keys)
        seen, admitted = self.seen, None
        for k, key in enumerate(keys):
            count = seen.pop(key, 0) + 1
            seen[key] = count
            if admitted is None and count < self.threshold:
                admitted = k
        while len(seen) > 4 * max(1, self.slots):
            seen.popitem(last=False)
        return len(keys) if admitted is None else admitted


class RequestRetention(RetentionPolicy):
    """What each request's ``kv_retention`` asks: its blocks kept at least ``ttl_s`` after
    its last use (the latest deadline wins), pinned (never evicted) until a request
    with ``pin: false`` unpins them, with at most ``max_pinned_share`` of the tier's
    blocks pinned (a pin past that is not granted). When every block the tier could
    evict is under a TTL, the one of the lowest ``priority`` (then the earliest
    deadline) goes: a TTL never makes the tier refuse a save; a pin does."""

    asked_only = True

    def __init__(self, slots: int, config: Any = None) -> None:
        super().__init__(slots, config)
        self.pin_cap = int(slots * float(getattr(config, "max_pinned_share", 0.25)))
        self.until: dict[bytes, float] = {}
        self.priority: dict[bytes, int] = {}
        #: Pinned keys and the slots each takes (the cap counts slots).
        self.pinned: dict[bytes, int] = {}
        self.pinned_slots = 0

    def requested(self, block: Block, retention: Retention, now: float) -> bool:
        key = block.key
        if retention.ttl_s:
            self.until[key] = max(self.until.get(key, 0.0), now + retention.ttl_s)
        if retention.priority or key in self.priority:
            self.priority[key] = retention.priority
        if retention.pin is False:
            self._unpin(key)
        elif retention.pin and key not in self.pinned:
            if self.pinned_slots + block.size > self.pin_cap:
                return False
            self.pinned[key] = block.size
            self.pinned_slots += block.size
        return True

    def _unpin(self, key: bytes) -> None:
        self.pinned_slots -= self.pinned.pop(key, 0)

    def kept(self, block: Block, now: float) -> bool:
        key = block.key
        if key in self.pinned:
            return True
        until = self.until.get(key)
        if until is None:
            return False
        if until <= now:
            del self.until[key]
            return False
        return True

    def yields(self, kept: Sequence[Block], now: float) -> Block | None:
        # O(len(kept)): asked only when every block the tier could evict is kept.
        soft = [b for b in kept if b.key not in self.pinned]
        return min(
            soft,
            key=lambda b: (self.priority.get(b.key, 0), self.until.get(b.key, 0.0)),
            default=None,
        )

    def removed(self, block: Block) -> None:
        self.until.pop(block.key, None)
        self.priority.pop(block.key, None)
        self._unpin(block.key)


BUILTIN: tuple[CachePolicy, ...] = (
    CachePolicy("lru", "eviction", Lru, "the least recently used block goes first"),
    CachePolicy(
        "arc",
        "eviction",
        Arc,
        "adaptive replacement: blocks seen once and blocks seen again in two lists, whose "
        "shares adapt to which list's evicted blocks come back",
    ),
    CachePolicy(
        "threshold",
        "admission",
        Threshold,
        "a block takes room once store_threshold requests have contained it",
    ),
    CachePolicy(
        "request",
        "retention",
        RequestRetention,
        "what each request's kv_retention asks: ttl_s, pin (capped), priority",
    ),
)
