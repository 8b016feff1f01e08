"""``kvc simulate``'s model of an ``offload-cpu`` node.

It drives the tier's own :class:`~kvc_offload_cpu.index.BlockIndex` (the same
eviction policy, ``lru`` or ``arc``, and allocation; its free slots counted, not
numbered: :class:`SlotCount`) with the rules of the
scheduler half (:mod:`kvc_offload_cpu.scheduler`): slots = capacity // bytes of
one slot, hits only of ready blocks and of at least ``min_blocks``, touch on
load, and at save a known block is touched, a new one allocated (evicting as
the policy says); with ``store_threshold`` a block is saved once that many
requests contained it (each request counted once, at its first save), and
with ``promote: never`` the blocks other nodes loaded are not saved. Saves
complete at once here, a position's entries together, as the real tier's
would with a prefill of one block a step (the tests drive the two side by
side so): the replay runs one request at a time, so no block is ever in
flight or pinned. A block belongs to its request's tenant (the
node's ``quotas``), and a request's ``kv_retention`` reaches the retention
policy at its end, with the trace's clock as the policy's ``now``.

With several KV cache groups (a hybrid model), as the scheduler half: a slot
holds one group's block, and an index entry a position's blocks of the groups
of one layout (a bundle, :func:`~kvc_offload_cpu.layout.bundles`), keyed by the
block key and the bundle; full attention keeps every block, window layouts
only the blocks :meth:`GroupLayout.needed
<kvc_offload_cpu.layout.GroupLayout.needed>` gives for the retained hit
points, and a hit is the longest prefix every group can serve.
A mamba group turns the node off, as the real one turns itself off. Given
``unit_blocks`` (a replay in whole trace blocks), a hit ends at a unit's end:
full attention keeps a unit as one entry, a window layout the blocks of it a
hit at a retained unit's end needs (:class:`~kvc_offload_cpu.layout.UnitRings`),
and capacity, evictions and slots saved count vLLM blocks.

A policy that raises is switched off as in the tier (:class:`PolicyHealth
<kvc_offload_cpu.policies.PolicyHealth>`): ``policies`` and ``policy_fallbacks`` say
so, and ``kvc simulate`` reports it beside the node's figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import cycle
from typing import Any

from pydantic import BaseModel

from composer import SimKVGroup, SimRequest
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.index import OTHERS, BlockIndex, Entry
from kvc_offload_cpu.layout import SERVED_KINDS, GroupLayout, UnitRings, bundles, unit_rings
from kvc_offload_cpu.policies import Admission

#: A window bundle's entries to store at a position: (key, slots, bytes) each.
Window = Callable[[int], list[tuple[bytes, int, int]]]


class SlotCount(BlockIndex):
    """The tier's index with its free slots counted, not named: ``allocate`` decides as
    the tier's (which entries go, in the policy's order, and when none may), but no
    slot has a number, which a replay never reads. That spares an entry's work per
    slot (a unit's entry holds many): the same entries, slots and evictions."""

    def _number_slots(self, num_slots: int) -> None:
        self.free_slots = num_slots  # (and no slot listed: a replay's pools are large)
        self._shapes: dict[int, tuple[int, ...]] = {}  # (one tuple of each size, shared)

    @property
    def used_slots(self) -> int:
        return self.num_slots - self.free_slots

    def allocate(self, key: bytes, tenant: str = "", size: int = 1) -> Entry | None:
        if key in self._entries:
            raise KeyError(f"key already indexed: {key.hex()}")
        if size > self.num_slots:
            return None
        owner = self.quotas.of(tenant) if self.quotas is not None else OTHERS
        while self.free_slots < size:
            victim = self._evict(owner, size - self.free_slots)
            if victim is None:
                return None
            self.free_slots += len(victim.slots)
        self.free_slots -= size
        slots = self._shapes.get(size) or self._shapes.setdefault(size, (0,) * size)
        entry = self._entries[key] = Entry(key, slots, 1, owner)
        if self.quotas is not None:
            self.quotas.held[owner] += size
        return entry

    def _free_slots(self, entry: Entry) -> None:
        self.free_slots += len(entry.slots)


class OffloadCPUModel:
    #: Replays a window model in units when given ``unit_blocks`` (``composer.TierModel``).
    window_units = True
    #: The index it drives (one that numbers slots records them: ``slot_patterns``).
    index_type: type[BlockIndex] = SlotCount

    def __init__(
        self,
        config: BaseModel,
        *,
        block_size: int,
        bytes_per_block: int,
        groups: Sequence[SimKVGroup] = (),
        unit_blocks: int = 1,
    ) -> None:
        assert isinstance(config, OffloadCPUConfig)
        self.config = config
        self.block_size = block_size
        #: The request being replayed (``arrive``).
        self.request = SimRequest()
        groups = tuple(groups) or (SimKVGroup("attention", bytes_per_block),)
        self.layouts = tuple(GroupLayout(g.kind, block_size, g.window) for g in groups)
        self.group_bytes = tuple(g.block_bytes for g in groups)
        self.bundles = bundles(self.layouts)
        self._units(unit_blocks)
        slot_bytes = bytes_per_block // self.unit_blocks  # (one group's block)
        slots = self.capacity_blocks = int(config.capacity) // slot_bytes if slot_bytes else 0
        self.index = self.index_type(
            slots,
            config.eviction,
            config,
            config.retention,
            clock=lambda: self.request.now,
            quotas=config.quotas,
        )
        self.admission = Admission(config.admission, slots, config, self.index.health)
        #: Each bundle's slots and bytes (of a unit's entry).
        self.bundle_sizes = [len(m) * self.unit_blocks for m in self.bundles.members]
        self.bundle_bytes = [sum(self.group_bytes[g] for g in m) for m in self.bundles.members]
        self.several = len(self.bundle_sizes) > 1
        self._suffixes = [bytes((b,)) for b in range(len(self.bundle_sizes))]
        self._keys_of: Sequence[bytes] | None = None
        self._keys: list[Sequence[bytes]] = []
        #: Bytes of one block position with every group at full attention.
        self.full_bytes = sum(
            b for x, b in zip(self.layouts, self.group_bytes, strict=True) if x.kind in SERVED_KINDS
        )
        self.bytes_loaded = self.bytes_saved = 0
        self._kept_bytes = self._full = 0  # bytes requests' saves keep, and with full attention
        self.disabled_reason: str | None = None
        unserved = sorted({x.kind for x in self.layouts if x.kind not in SERVED_KINDS})
        if unserved:  # the scheduler half's reason, as it logs it
            self.disabled_reason = (
                f"the model has {'/'.join(unserved)} KV cache groups: their recurrent state is "
                "not restorable from blocks (vLLM keeps no per-block state snapshots here)"
            )

    def _units(self, unit_blocks: int) -> None:
        """With ``unit_blocks`` and a window layout: each window bundle's rings (a slot is
        then a block of one group, and an entry of a unit or a ring holds many: the
        index counts its free slots, so that costs no work per slot)."""
        self.rings: dict[int, UnitRings] = {}
        #: Each window bundle's layout of vLLM blocks (what a load reads of it).
        self.window_layouts: dict[int, GroupLayout] = {}
        if unit_blocks > 1:
            vllm_block = self.block_size // unit_blocks
            every = self.config.window_retention // vllm_block
            whole = every > 0 and unit_blocks % every == 0  # every unit's end retained
            for b in self.bundles.window:
                x = self.bundles.layouts[b]
                layout = self.window_layouts[b] = GroupLayout(x.kind, vllm_block, x.window)
                self.rings[b] = unit_rings(layout, unit_blocks, whole)
        #: vLLM blocks a key stands for (1 unless in rings).
        self.unit_blocks = unit_blocks if self.rings else 1
        self._loose = 0  # (entries of blocks no ring holds: a key each)
        #: Per window bundle, per unit phase, per ring: (key suffix, slots, bytes).
        self._rings: dict[int, list[list[tuple[bytes, int, int]]]] = {}
        #: Per window bundle, bytes of a block of its groups.
        self._block_bytes: dict[int, int] = {}
        for b, rings in self.rings.items():
            m, nbytes = self.bundles.members[b], self.group_bytes
            per_block = self._block_bytes[b] = sum(nbytes[g] for g in m) // self.unit_blocks
            self._rings[b] = [
                [(bytes((b,)) + i.to_bytes(2, "little"), len(m) * n, per_block * n)
                 for i, (_, n, _) in enumerate(phase)]
                for phase in rings.rings
            ]

    @property
    def evictions(self) -> int:
        return self.index.evictions

    @property
    def policies(self) -> dict[str, str]:
        """Each kind's cache policy in force (``lfu → lru after 1,203 evictions`` once one
        raised: the figures from then on are its fallback's)."""
        return self.index.health.in_force()

    @property
    def policy_fallbacks(self) -> list[dict[str, Any]]:
        """Each policy switched off because it raised (:class:`PolicyFallback`'s fields)."""
        return [f.as_dict() for f in self.index.health.fallbacks.values()]

    @property
    def window_saving(self) -> float | None:
        if not self.bundles.window or self.disabled_reason:
            return None
        return self._kept_bytes / self._full if self._full else 1.0

    def _bundle_keys(self, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        """Each bundle's index keys of ``keys`` (the block key and the bundle; the block
        key alone with one bundle), made once per request: its lookup, load and save ask
        them all (the replay hands each the same list). A ring's, when asked for."""
        if keys is not self._keys_of:
            self._keys_of = keys
            self._keys = (
                [
                    () if b in self.rings else [k + suffix for k in keys]
                    for b, suffix in enumerate(self._suffixes)
                ]
                if self.several
                else [keys]
            )
        return self._keys

    def arrive(self, request: SimRequest) -> None:
        self.request = request

    def lookup(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        if self.disabled_reason:
            return 0
        ready, gkeys = self.index.ready, self._bundle_keys(keys)
        full = [gkeys[b] for b in self.bundles.full]
        end, stop = start, min(limit, len(keys))
        # Full attention: the longest run of stored blocks.
        while end < stop and all(ready(bundle[end]) is not None for bundle in full):
            end += 1
        # Window layouts: the longest of those ends whose window they hold.
        while end > start and not self._held(keys, gkeys, start, end):
            end -= 1
        hit = end - start
        return hit if hit >= self.config.min_blocks else 0

    def _held(
        self, keys: Sequence[bytes], gkeys: list[Sequence[bytes]], start: int, end: int
    ) -> bool:
        """Whether the window layouts hold what a hit of blocks ``[start, end)`` needs."""
        ready = self.index.ready
        if self.rings:
            return all(
                ready(key) is not None
                for b in self.rings
                for key in self._needed(b, keys, start, end)
            )
        return all(
            ready(gkeys[b][k]) is not None
            for b in self.bundles.window
            for k in self.bundles.layouts[b].needed(start, end)
        )

    def _needed(self, b: int, keys: Sequence[bytes], start: int, end: int) -> list[bytes]:
        """The keys of the rings of window bundle ``b`` a hit of units ``[start, end)``
        needs (those vLLM does not hold: of units from ``start``)."""
        rings, items = self.rings[b], self._rings[b]
        period = rings.period
        return [
            keys[end - back] + items[(end - back) % period][i][0]
            for back, i in rings.needs[end % period]
            if end - back >= start
        ]

    def load(self, keys: Sequence[bytes], start: int, hit: int) -> None:
        index, gkeys = self.index, self._bundle_keys(keys)
        for g, layout in enumerate(self.layouts):  # (group by group, as the scheduler half)
            # vLLM holds null blocks outside a window: nothing is loaded there.
            b = self.bundles.of[g][0]
            if b in self.rings:
                for key in self._needed(b, keys, start, start + hit):
                    entry = index.ready(key)
                    if entry is not None:
                        index.touch(entry)
                unit, needed = self.unit_blocks, self.window_layouts[b].needed
                blocks = len(needed(start * unit, (start + hit) * unit))
                self.bytes_loaded += self.group_bytes[g] // unit * blocks
                continue
            bundle = gkeys[b]
            for k in layout.needed(start, start + hit):
                entry = index.ready(bundle[k])
                if entry is not None:
                    index.touch(entry)
                    self.bytes_loaded += self.group_bytes[g]

    def save(
        self,
        keys: Sequence[bytes],
        prompt_tokens: int,
        computed: int,
        loaded: Sequence[tuple[int, int]] = (),
    ) -> int:
        # The real tier disables itself when no position of its largest bundle fits.
        if self.capacity_blocks < self.bundles.largest or self.disabled_reason:
            return 0
        prompt_blocks = min(prompt_tokens // self.block_size, len(keys))
        stop = prompt_blocks if self.config.save == "prompt" else len(keys)
        stop = min(stop, self._admitted(keys, prompt_blocks))
        sizes, blocks = self.bundle_bytes, stop
        if self.rings:  # (counted as the tier would: to the prompt's last full block)
            bs = self.block_size // self.unit_blocks
            blocks = prompt_tokens // bs if stop >= prompt_blocks else stop * self.unit_blocks
            kept = self._kept_rings(keys, stop, prompt_tokens, computed, blocks)
            window, loose, kept_bytes = kept
            stored = self._store(keys, stop, computed, window, loaded, loose)
            sizes = [n // self.unit_blocks for n in sizes]
        else:
            keep = {
                b: self.bundles.layouts[b].kept_blocks(
                    stop, prompt_tokens, self.config.window_retention
                )
                for b in self.bundles.window
            }
            kept_bytes = sum(sizes[b] * len(positions) for b, positions in keep.items())
            gkeys = self._bundle_keys(keys)
            window = {b: self._blocks_at(gkeys[b], b, kept) for b, kept in keep.items()}
            stored = self._store(keys, stop, computed, window, loaded)
        if self.bundles.window:
            self._full += blocks * self.full_bytes // self.unit_blocks
            self._kept_bytes += sum(sizes[b] * blocks for b in self.bundles.full) + kept_bytes
        self._retain(keys)
        return stored

    def _blocks_at(self, blocks: Sequence[bytes], b: int, kept: set[int]) -> Window:
        """Window bundle ``b``'s entry at a position it keeps (as ``_store`` asks)."""
        size, nbytes = self.bundle_sizes[b], self.bundle_bytes[b]
        return lambda k: [(blocks[k], size, nbytes)] if k in kept else []

    def _rings_at(self, keys: Sequence[bytes], b: int, kept: list[tuple[int, ...]]) -> Window:
        """Window bundle ``b``'s rings it keeps of a unit (as ``_store`` asks)."""
        items = self._rings[b]
        period = len(items)

        def at(k: int) -> list[tuple[bytes, int, int]]:
            phase = items[k % period]
            return [(keys[k] + phase[i][0], phase[i][1], phase[i][2]) for i in kept[k]]

        return at

    def _kept_rings(
        self, keys: Sequence[bytes], stop: int, prompt_tokens: int, computed: int, blocks: int
    ) -> tuple[dict[int, Window], list[tuple[bytes, int, int]], int]:
        """What a save in units keeps of each window bundle: of the units, the rings a hit
        at a retained unit's end needs (:meth:`UnitRings.kept
        <kvc_offload_cpu.layout.UnitRings.kept>`), as ``window`` for :meth:`_store`;
        the blocks no ring holds that the tier keeps (:meth:`UnitRings.loose
        <kvc_offload_cpu.layout.UnitRings.loose>`, of the first ``blocks``), an entry a
        bundle that no hit asks for; and the bytes kept."""
        unit = self.unit_blocks
        bs = self.block_size // unit
        ends = (max(0, prompt_tokens - 1) // bs, prompt_tokens // bs)
        every = self.config.window_retention // bs
        window: dict[int, Window] = {}
        loose: list[tuple[bytes, int, int]] = []
        kept_bytes = 0
        for b, rings in self.rings.items():
            kept = rings.kept(stop, every, ends)
            items, per_block = self._rings[b], self._block_bytes[b]
            window[b] = self._rings_at(keys, b, kept)
            phases = Counter(zip(cycle(range(rings.period)), kept, strict=False))
            kept_bytes += per_block * rings.loose(ends, kept, 0, blocks) + sum(
                n * sum(items[at][i][2] for i in ring) for (at, ring), n in phases.items()
            )
            n = rings.loose(ends, kept, computed * unit, blocks)
            if n:
                self._loose += 1
                key = b"loose" + self._loose.to_bytes(8, "little")
                loose.append((key, len(self.bundles.members[b]) * n, per_block * n))
        return window, loose, kept_bytes

    def _store(
        self,
        keys: Sequence[bytes],
        stop: int,
        computed: int,
        window: dict[int, Window],
        loaded: Sequence[tuple[int, int]],
        after: Sequence[tuple[bytes, int, int]] = (),
    ) -> int:
        """Store positions ``[0, stop)`` in bundle order: a full bundle's entry, and those
        ``window`` gives (key, slots, bytes) of a window bundle's where the request
        computed the position (a window layout saves only blocks it computes itself);
        then ``after``. Until an entry finds no slots; returns the slots newly stored."""
        index, tenant, never = self.index, self.request.tenant, self.config.promote == "never"
        get, touch, allocate, ready = index.get, index.touch, index.allocate, index.mark_ready
        gkeys = self._bundle_keys(keys)
        plan = [
            (gkeys[b], self.bundle_sizes[b], self.bundle_bytes[b], window.get(b))
            for b in range(len(self.bundle_sizes))
        ]
        stored = 0
        for k in range(stop + 1):
            if k == stop:
                todo: Sequence[tuple[bytes, int, int]] = after
            elif never and any(first <= k < end for first, end in loaded):
                continue  # another node loaded it: not promoted
            else:
                todo = []
                for blocks, size, added, entries in plan:
                    if entries is None:
                        todo.append((blocks[k], size, added))
                    elif k >= computed:
                        todo += entries(k)
            # A position's entries are ready together, as a step's saves are.
            new: list[Entry] = []
            for block, slots, nbytes in todo:
                known = get(block)
                if known is not None:
                    touch(known)
                    continue
                # None: every block is kept (retention) or the tenant is at its share;
                # the real tier tries again next step, where a replay has nothing new.
                entry = allocate(block, tenant, slots)
                if entry is None:
                    for entry in new:
                        ready(entry)
                    return stored
                new.append(entry)
                stored += slots
                self.bytes_saved += nbytes
            for entry in new:
                ready(entry)
        return stored

    def _retain(self, keys: Sequence[bytes]) -> None:
        """The request's ``kv_retention`` for each of its blocks the tier holds (as the
        scheduler half's ``request_finished``)."""
        retention = self.request.retention
        if retention is None:
            return
        index = self.index
        blocks = [block for bundle in self._bundle_keys(keys) for block in bundle]
        for b, rings in self.rings.items():
            blocks += [
                key + item[0]
                for j, key in enumerate(keys)
                for item in self._rings[b][j % rings.period]
            ]
        for block in blocks:
            entry = index.get(block)
            if entry is not None:
                index.retain(entry, retention)

    def _admitted(self, keys: Sequence[bytes], prompt_blocks: int) -> int:
        """The leading blocks the admission policy admits (as the scheduler half asks it:
        its prompt's blocks); all of them when it admits the whole prompt."""
        admitted = self.admission.admit(keys[:prompt_blocks])
        return len(keys) if admitted >= prompt_blocks else admitted
