"""``kvc simulate``'s model of an ``offload-cpu`` node.

It drives the tier's own :class:`~kvc_offload_cpu.index.BlockIndex` (the same
eviction policy, ``lru`` or ``arc``, and slot allocation) with the rules of the
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
A mamba group turns the node off, as the real one turns itself off.

A policy that raises is switched off as in the tier (:class:`PolicyHealth
<kvc_offload_cpu.policies.PolicyHealth>`): ``policies`` and ``policy_fallbacks`` say
so, and ``kvc simulate`` reports it beside the node's figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from composer import SimKVGroup, SimRequest
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.index import BlockIndex, Entry
from kvc_offload_cpu.layout import SERVED_KINDS, GroupLayout, bundles
from kvc_offload_cpu.policies import Admission


class OffloadCPUModel:
    def __init__(
        self,
        config: BaseModel,
        *,
        block_size: int,
        bytes_per_block: int,
        groups: Sequence[SimKVGroup] = (),
    ) -> None:
        assert isinstance(config, OffloadCPUConfig)
        self.config = config
        self.block_size = block_size
        self.capacity_blocks = int(config.capacity) // bytes_per_block if bytes_per_block else 0
        #: The request being replayed (``arrive``).
        self.request = SimRequest()
        self.index = BlockIndex(
            self.capacity_blocks,
            config.eviction,
            config,
            config.retention,
            clock=lambda: self.request.now,
            quotas=config.quotas,
        )
        self.admission = Admission(
            config.admission, self.capacity_blocks, config, self.index.health
        )
        groups = tuple(groups) or (SimKVGroup("attention", bytes_per_block),)
        self.layouts = tuple(GroupLayout(g.kind, block_size, g.window) for g in groups)
        self.group_bytes = tuple(g.block_bytes for g in groups)
        self.bundles = bundles(self.layouts)
        #: Each bundle's slots and bytes.
        self.bundle_sizes = [len(m) for m in self.bundles.members]
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
        them all (the replay hands each the same list)."""
        if keys is not self._keys_of:
            self._keys_of = keys
            self._keys = (
                [[k + suffix for k in keys] for suffix in self._suffixes]
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
        while end > start and not all(
            ready(gkeys[b][k]) is not None
            for b in self.bundles.window
            for k in self.bundles.layouts[b].needed(start, end)
        ):
            end -= 1
        hit = end - start
        return hit if hit >= self.config.min_blocks else 0

    def load(self, keys: Sequence[bytes], start: int, hit: int) -> None:
        index, gkeys = self.index, self._bundle_keys(keys)
        for g, layout in enumerate(self.layouts):  # (group by group, as the scheduler half)
            # vLLM holds null blocks outside a window: nothing is loaded there.
            bundle = gkeys[self.bundles.of[g][0]]
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
        keep = {
            b: self.bundles.layouts[b].kept_blocks(
                stop, prompt_tokens, self.config.window_retention
            )
            for b in self.bundles.window
        }
        if keep:
            sizes = self.bundle_bytes
            self._full += stop * self.full_bytes
            self._kept_bytes += sum(sizes[b] * stop for b in self.bundles.full) + sum(
                sizes[b] * len(positions) for b, positions in keep.items()
            )
        stored = self._store(keys, stop, computed, keep, loaded)
        self._retain(keys)
        return stored

    def _store(
        self,
        keys: Sequence[bytes],
        stop: int,
        computed: int,
        keep: dict[int, set[int]],
        loaded: Sequence[tuple[int, int]],
    ) -> int:
        """Store blocks ``[0, stop)`` of every bundle (as ``save`` decided), until an
        entry finds no slots; returns the slots newly stored."""
        index, gkeys, tenant = self.index, self._bundle_keys(keys), self.request.tenant
        sizes, nbytes = self.bundle_sizes, self.bundle_bytes
        never = self.config.promote == "never"
        bundles = range(len(sizes))
        # A window layout saves only blocks the request computes itself, and of those
        # the ones it keeps: the bundles each position stores, in bundle order.
        others = [b for b in bundles if b not in keep]
        stored = 0
        for k in range(stop):
            if never and any(a <= k < b for a, b in loaded):
                continue  # another node loaded it: not promoted
            at = others if k < computed else [b for b in bundles if b not in keep or k in keep[b]]
            # A position's entries are ready together, as a step's saves are.
            new: list[Entry] = []
            full = False
            for b in at:
                block = gkeys[b][k]
                known = index.get(block)
                if known is not None:
                    index.touch(known)
                    continue
                # None: every block is kept (retention) or the tenant is at its share;
                # the real tier tries again next step, where a replay has nothing new.
                entry = index.allocate(block, tenant, sizes[b])
                if entry is None:
                    full = True
                    break
                new.append(entry)
                stored += sizes[b]
                self.bytes_saved += nbytes[b]
            for entry in new:
                index.mark_ready(entry)
            if full:
                return stored
        return stored

    def _retain(self, keys: Sequence[bytes]) -> None:
        """The request's ``kv_retention`` for each of its blocks the tier holds (as the
        scheduler half's ``request_finished``)."""
        retention = self.request.retention
        if retention is None:
            return
        index = self.index
        for bundle in self._bundle_keys(keys):
            for block in bundle:
                entry = index.get(block)
                if entry is not None:
                    index.retain(entry, retention)

    def _admitted(self, keys: Sequence[bytes], prompt_blocks: int) -> int:
        """The leading blocks the admission policy admits (as the scheduler half asks it:
        its prompt's blocks); all of them when it admits the whole prompt."""
        admitted = self.admission.admit(keys[:prompt_blocks])
        return len(keys) if admitted >= prompt_blocks else admitted
