"""The scheduler half's index: block key -> slots of the host pool, eviction, pins.

The index never touches bytes. An entry holds one slot, or, for a hybrid
model, one slot per KV cache group of a *bundle* (the groups of one layout,
:attr:`BlockLayout.bundles <kvc_offload_cpu.layout.BlockLayout.bundles>`): a
position's blocks of those groups are kept, served and evicted together, as
one entry. A slot's *generation* grows every time the slot is given to a new
key, so a worker can tell a slot that was overwritten from the one a load was
planned against. Which ready block goes first when the pool
is full is the eviction policy's, a cache policy plugin the node config names
(``eviction: lru``; :mod:`composer.policy`): the index tells it each block that
becomes ready, is served or leaves, and takes the first unpinned block of its
``victims()``. A pinned block is never a victim. The walk of ``victims()``
stops at the first block that may go and drops the iterator before the policy
hears of anything, so a policy may hand out a lazy view of its own lists: an
eviction costs what the policy's walk to that block costs, not the pool's size
(:meth:`BlockIndex._victim`).

A policy that raises (eviction, admission or retention) is switched off and
replaced by its fallback (``lru`` over the blocks the index holds; every block
admitted; no block kept), said once on the log in one line naming the policy,
the method and the error (:class:`~kvc_offload_cpu.policies.PolicyHealth`): no
block and no request is lost to it, and the tier reports the policy in force
from then on (``lfu → lru after 1,203 evictions``).

With per-tenant quotas (:class:`Quotas`, the node's ``quotas``) each block
belongs to its request's tenant (vLLM's ``cache_salt``), each tenant's blocks
are ordered by an eviction policy of their own (sized by the tenant's share:
finding a tenant's next victim never walks another tenant's blocks), and when
the pool is full a tenant at its share evicts its own blocks first, then those
of tenants past theirs (the furthest past first), never a block of a tenant
within its share; a tenant within its share evicts from tenants past theirs
first. Free slots are anyone's: a quota bites only when the pool is full.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from composer import EvictionPolicy, Retention, RetentionPolicy, find_policy
from kvc_offload_cpu.policies import Admission as Admission  # (re-exported: it lived here)
from kvc_offload_cpu.policies import PolicyHealth
from kvc_offload_cpu.slots import NumberedSlots

#: The tenants a quota does not name, together (and a request without a ``cache_salt``).
OTHERS = "*"


class Entry:
    __slots__ = ("key", "slots", "gen", "tenant", "ready", "pins", "dropped", "event")

    def __init__(self, key: bytes, slots: tuple[int, ...], gen: int, tenant: str = OTHERS) -> None:
        self.key = key
        #: Its slots (one per KV cache group of its bundle), each at generation ``gen``.
        self.slots = slots
        self.gen = gen
        #: Whose block it is: a tenant a quota names, or :data:`OTHERS`.
        self.tenant = tenant
        #: False while the save is in flight: not a hit until every worker confirms it.
        self.ready = False
        #: Pending loads reading this slot; a pinned slot is never evicted or reused.
        self.pins = 0
        #: Removed from the index while pinned; the slot is freed at the last unpin.
        self.dropped = False
        #: The scheduler's KV cache event state for this entry (None: none).
        self.event: Any = None

    @property
    def size(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        state = "ready" if self.ready else "saving"
        return f"Entry(slots={self.slots}, gen={self.gen}, {state}, pins={self.pins})"


class Quotas:
    """Each tenant's share of the pool (``quotas``: tenant -> share; :data:`OTHERS`
    names everyone else, and gets what the named shares leave when not given), in
    slots, and the slots each holds now."""

    def __init__(self, shares: Mapping[str, float], num_slots: int) -> None:
        self.limit = {tenant: int(share * num_slots) for tenant, share in shares.items()}
        self.limit.setdefault(OTHERS, num_slots - sum(self.limit.values()))
        self.held: Counter[str] = Counter()
        #: Blocks evicted, by tenant.
        self.evicted: Counter[str] = Counter()

    def of(self, tenant: str) -> str:
        """The quota ``tenant`` (a request's ``cache_salt``, "" for none) counts against."""
        return tenant if tenant in self.limit and tenant != "" else OTHERS

    def past(self) -> set[str]:
        """The tenants holding more than their share."""
        return {t for t, n in self.held.items() if n > self.limit[t]}

    def room(self, tenant: str) -> int:
        """Slots ``tenant`` may still take within its share (below 0: past it)."""
        return self.limit[tenant] - self.held[tenant]


class BlockIndex(NumberedSlots):
    """Maps block keys to slots of a pool of ``num_slots`` blocks (its slots:
    :class:`~kvc_offload_cpu.slots.NumberedSlots`)."""

    def __init__(
        self,
        num_slots: int,
        eviction: str | EvictionPolicy = "lru",
        config: Any = None,
        retention: str | RetentionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        quotas: Mapping[str, float] | None = None,
    ) -> None:
        """``eviction``, ``retention``: policies, or the names of installed ones (built
        with the pool's size and ``config``, the node's); no retention: none kept.
        ``clock``: the retention policy's ``now`` (the simulator's is the trace's).
        ``quotas``: each tenant's share of the pool (None or empty: no quotas)."""
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._entries: dict[bytes, Entry] = {}
        self.config = config
        self.eviction = eviction if isinstance(eviction, str) else type(eviction)
        self.quotas = Quotas(quotas, num_slots) if quotas else None
        #: Ordering the ready entries of each tenant (one, :data:`OTHERS`, without
        #: quotas): each is ``added`` once ready and ``removed`` when it leaves, while
        #: still ready.
        self.policies: dict[str, EvictionPolicy] = (
            {OTHERS: self._new_policy(self.eviction, num_slots)}
            if isinstance(eviction, str) or self.quotas is not None
            else {OTHERS: eviction}
        )
        if self.quotas is not None:
            for tenant, limit in self.quotas.limit.items():
                self.policies[tenant] = self._new_policy(self.eviction, max(1, limit))
        #: Which blocks must stay, of those the eviction policy offers (None: none).
        self.retention: RetentionPolicy | None = (
            find_policy("retention", retention)(num_slots, config)
            if isinstance(retention, str)
            else retention
        )
        self.clock = clock
        #: Whether the retention policy is asked (one ``asked_only`` is, once a request asked).
        self.consulted = self.retention is not None and not self.retention.asked_only
        #: The policies as configured and as in force (the tier's admission policy too).
        self.health = PolicyHealth(lambda: self.evictions)
        self.health.configured["eviction"] = (
            eviction if isinstance(eviction, str) else type(eviction).__name__
        )
        if self.retention is not None:
            self.health.configured["retention"] = (
                retention if isinstance(retention, str) else type(self.retention).__name__
            )
        self._number_slots(num_slots)
        self.evictions = 0
        #: Called with every entry that leaves the index (evicted, dropped, reset).
        self.on_remove: Callable[[Entry], None] | None = None

    def _new_policy(self, eviction: str | type, slots: int) -> EvictionPolicy:
        cls = find_policy("eviction", eviction) if isinstance(eviction, str) else eviction
        policy: EvictionPolicy = cls(slots, self.config)
        return policy

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy of the tenants no quota names (of every block, without quotas)."""
        return self.policies[OTHERS]

    # -- queries ------------------------------------------------------------ #

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entries(self) -> list[Entry]:
        """Every indexed entry (ready or being saved)."""
        return list(self._entries.values())

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def ready(self, key: bytes) -> Entry | None:
        """The entry for ``key`` if it can be served now (saved and confirmed)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.ready else None

    # -- updates ------------------------------------------------------------ #

    def touch(self, entry: Entry) -> None:
        if entry.ready and self._entries.get(entry.key) is entry:
            try:
                self.policies[entry.tenant].touched(entry)
            except Exception as exc:
                self._policy_failed("touched", exc)

    def allocate(self, key: bytes, tenant: str = "", size: int = 1) -> Entry | None:
        """``size`` slots (one per group of a bundle) for a new entry of ``tenant`` (its
        request's ``cache_salt``), free ones first, then the slots of the eviction
        policy's first entries (as the quotas allow); None: no entry may go (the
        slots of those it evicted stay free)."""
        if key in self._entries:
            raise KeyError(f"key already indexed: {key.hex()}")
        if size > self.num_slots:
            return None
        owner = self.quotas.of(tenant) if self.quotas is not None else OTHERS
        free, gen = self._free, self._gen
        while len(free) < size:
            victim = self._evict(owner, size - len(free))
            if victim is None:
                return None
            if not free and len(victim.slots) == size:  # (a full pool: most evictions)
                return self._place(key, victim.slots, victim.gen + 1, owner)
            self._free_slots(victim)
        if size == 1:
            slot = heapq.heappop(free)
            return self._place(key, (slot,), gen[slot] + 1, owner)
        slots = tuple([heapq.heappop(free) for _ in range(size)])
        # One generation for the entry, past each of its slots' own.
        return self._place(key, slots, max([gen[slot] for slot in slots]) + 1, owner)

    def _place(self, key: bytes, slots: tuple[int, ...], gen: int, owner: str) -> Entry:
        entry = Entry(key, slots, gen, owner)
        for slot in slots:
            self._gen[slot] = gen
            self._by_slot[slot] = entry
        self._entries[key] = entry
        if self.quotas is not None:
            self.quotas.held[owner] += len(slots)
        return entry

    def _evict(self, owner: str, need: int) -> Entry | None:
        """Evict the next entry for ``need`` more slots of ``owner`` (its slots are the
        caller's to free or reuse); None: none may go."""
        quotas = self.quotas
        victim = self._victim(OTHERS) if quotas is None else self._victim_for(owner, need)
        if victim is None:
            return None
        self._remove(victim, evicted=True)
        self.evictions += len(victim.slots)
        if quotas is not None:
            quotas.evicted[victim.tenant] += len(victim.slots)
        return victim

    def mark_ready(self, entry: Entry) -> None:
        if entry.dropped or self._entries.get(entry.key) is not entry:
            return
        entry.ready = True
        try:
            self.policies[entry.tenant].added(entry)
        except Exception as exc:
            self._policy_failed("added", exc)

    def drop(self, entry: Entry) -> None:
        """Forget ``entry`` (failed save, corrupt data); its slots are freed once unpinned."""
        if self._entries.get(entry.key) is not entry:
            return
        if entry.pins:
            del self._entries[entry.key]
            self._left_quota(entry)
            self._left_policy(entry, evicted=False)
            entry.dropped = True
            if self.on_remove is not None:
                self.on_remove(entry)
        else:
            self._remove(entry)
            self._free_slots(entry)

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, entry
        if entry.pins == 0 and entry.dropped:
            entry.dropped = False  # freed once
            self._free_slots(entry)

    def reset(self) -> int:
        """Drop every ready, unpinned entry (``reset_cache``); returns how many."""
        victims = [e for e in self._entries.values() if e.ready and e.pins == 0]
        for entry in victims:
            self.drop(entry)
        return len(victims)

    def _remove(self, entry: Entry, evicted: bool = False) -> None:
        del self._entries[entry.key]
        self._left_quota(entry)
        self._left_policy(entry, evicted)
        if self.on_remove is not None:
            self.on_remove(entry)

    def _left_quota(self, entry: Entry) -> None:
        if self.quotas is not None:
            self.quotas.held[entry.tenant] -= len(entry.slots)

    # -- the policy ----------------------------------------------------------- #

    def _victim_for(self, owner: str, need: int = 1) -> Entry | None:
        """The next entry to go for ``need`` more slots of ``owner`` (see the module's
        docstring)."""
        quotas = self.quotas
        if quotas is None:
            return self._victim(OTHERS)
        if quotas.held[owner] + need > quotas.limit[owner]:
            return self._victim(owner) or self._first_victim(quotas.past() - {owner})
        # (Nobody past: the shares' rounding left slots over; anyone's, furthest first.)
        return self._first_victim(quotas.past()) or self._first_victim(set(quotas.limit))

    def _first_victim(self, tenants: set[str]) -> Entry | None:
        """The first victim of ``tenants``, the furthest past its share first."""
        assert self.quotas is not None
        room = self.quotas.room
        for tenant in sorted(tenants, key=lambda t: (room(t), t)):
            victim = self._victim(tenant)
            if victim is not None:
                return victim
        return None

    def _victim(self, tenant: str) -> Entry | None:
        """``tenant``'s eviction policy's first block not in use and not kept by the
        retention policy; when every one is kept, the one retention yields (None:
        none).

        The contract with the policy: its ``victims()`` is walked only up to the
        block returned, and the iterator is dropped before the policy hears of
        anything (``removed``, ``added``, ``passed_over`` come after), so a policy may
        yield lazily from its own ordered dicts (``arc`` does; ``lru`` returns one's
        iterator). What an eviction costs is then the blocks walked:

        * blocks a load is reading: skipped where they are; a load touches its
          blocks, so they are at the back of a recency order;
        * blocks the retention policy keeps (pins, TTLs): passed over, then told to
          the policy (``passed_over``): ``lru`` and ``arc`` move them to the back of
          their order, so the next eviction does not walk them again. With K of the
          N blocks kept, an eviction walks about K/(N-K) of them, not K. (A policy
          that leaves ``passed_over`` to the spec's default walks them every time.)
          A kept block so stays at least as long as asked; once its keep is over,
          it goes in the policy's order as a block last used when last passed over;
        * when every block is kept, all of them, and the retention policy chooses
          (``yields``): O(blocks kept) an eviction, as long as that lasts.
        """
        passed: list[Entry] = []
        consulted = self.consulted
        now = self.clock() if consulted else 0.0
        entries = self._entries
        victim: Entry | None = None
        try:
            for block in self.policies[tenant].victims():
                entry = entries.get(block.key)
                if entry is not block or not entry.ready or entry.pins:
                    continue
                if consulted and self._kept(entry, now):
                    passed.append(entry)
                    continue
                victim = entry
                break
        except Exception as exc:
            self._policy_failed("victims", exc)
            return self._victim(tenant)
        if victim is not None:
            if passed:  # (the usual eviction passes over nothing)
                self._pass_over(tenant, passed)
            return victim
        if not passed or self.retention is None:
            return None
        try:
            chosen = self.retention.yields(passed, now)
        except Exception as exc:
            self._retention_failed("yields", exc)
            return passed[0]
        return next((e for e in passed if e is chosen), None)

    def _pass_over(self, tenant: str, kept: list[Entry]) -> None:
        """The blocks of ``tenant`` an eviction passed over because they are kept, told to
        its eviction policy (``passed_over``: out of the next eviction's way, see
        :meth:`_victim`)."""
        policy = self.policies[tenant]
        for entry in kept:
            try:
                policy.passed_over(entry)
            except Exception as exc:
                self._policy_failed("passed_over", exc)
                return

    def _kept(self, entry: Entry, now: float) -> bool:
        if self.retention is None:
            return False
        try:
            return bool(self.retention.kept(entry, now))
        except Exception as exc:
            self._retention_failed("kept", exc)
            return False

    def retain(self, entry: Entry, retention: Retention) -> bool:
        """A request that used ``entry`` asked for ``retention`` (it just finished);
        False: not granted."""
        if self.retention is None or self._entries.get(entry.key) is not entry:
            return False
        self.consulted = True
        try:
            return bool(self.retention.requested(entry, retention, self.clock()))
        except Exception as exc:
            self._retention_failed("requested", exc)
            return False

    def _left_policy(self, entry: Entry, evicted: bool) -> None:
        if self.consulted and self.retention is not None:
            try:
                self.retention.removed(entry)
            except Exception as exc:
                self._retention_failed("removed", exc)
        if not entry.ready:
            return  # never added: a save still in flight
        try:
            self.policies[entry.tenant].removed(entry, evicted)
        except Exception as exc:
            self._policy_failed("removed", exc)

    def _retention_failed(self, hook: str, exc: BaseException) -> None:
        """The retention policy raised in ``hook``: none from now on (no block kept)."""
        policy, self.retention = self.retention, None
        self.consulted = False
        self.health.failed("retention", policy, hook, exc)

    def _policy_failed(self, hook: str, exc: BaseException) -> None:
        """An eviction policy raised in ``hook``: lru from now on, for every tenant, over
        the ready blocks still indexed."""
        failed = self.policy
        self.eviction = "lru"
        for tenant, old in self.policies.items():
            self.policies[tenant] = self._new_policy("lru", old.slots)
        for entry in self._entries.values():
            if entry.ready:
                self.policies[entry.tenant].added(entry)
        self.health.failed("eviction", failed, hook, exc)
