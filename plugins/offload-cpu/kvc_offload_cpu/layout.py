"""What one KV block costs to store, and which blocks a hit needs, per KV cache group.

Read from vLLM's ``KVCacheConfig`` (no torch). The scheduler half sizes its
slot index from it; the worker half checks it against the canonical view
(``CanonicalKVCaches``) it actually copies.

With vLLM's hybrid KV cache manager a model has one group per kind of layer
(full attention, sliding window, chunked local attention, mamba). Every group
draws its blocks from one pool, so a block id is one group's block; the tier
stores one group's block per slot. Groups of one layout (vLLM splits a
hybrid's window layers into several groups of one window) keep and need the
same blocks: the tier indexes a position's blocks of them as one entry, a
*bundle* (:func:`bundles`). Without the hybrid manager (or for a plain model)
there is one group, and a slot holds one block of every layer, as before.
``kvc simulate``, replaying whole trace blocks, asks a window group's blocks of
a trace block in runs (:class:`UnitRings`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd, lcm
from typing import Any

#: Group kinds the tier can restore from blocks alone (state groups cannot).
SERVED_KINDS = ("attention", "sliding_window", "chunked_local")


@dataclass(frozen=True)
class GroupLayout:
    kind: str  # "attention", "sliding_window", "chunked_local", "mamba", ...
    block_size: int  # tokens per block
    #: Sliding window or attention chunk, in tokens (0 for full attention).
    window: int = 0

    def needed(self, start: int, end: int) -> range:
        """Block positions this group must hold for a hit covering blocks ``[0, end)``,
        given that vLLM already has blocks ``[0, start)``.

        vLLM's own rule (``SlidingWindowManager``/``ChunkedLocalAttentionManager``):
        positions the next token cannot attend to are null blocks, never loaded.
        """
        tokens = end * self.block_size
        if self.kind == "sliding_window":
            skipped = max(0, tokens - self.window + 1)
        elif self.kind == "chunked_local":
            skipped = tokens // self.window * self.window if self.window else 0
        else:
            skipped = 0
        return range(max(start, skipped // self.block_size), end)

    def kept(self, k: int, prompt_tokens: int, retention_tokens: int) -> bool:
        """Whether a tier saves block ``k`` of this window group for a prompt of
        ``prompt_tokens`` (``window_retention``: ``retention_tokens``).

        A hit ending at block ``h`` needs only the blocks inside the window
        before ``h``; the retained hit points are every ``retention_tokens``
        tokens and the two ends of the prompt (an exact repeat stops one token
        short of it; a follow-up turn extends it). A window's start only moves
        forward with ``h``, so the nearest point above ``k`` of each kind decides.
        """
        bs = self.block_size
        points = [max(0, prompt_tokens - 1) // bs, prompt_tokens // bs]
        every = retention_tokens // bs
        if every:
            points.append((k // every + 1) * every)
        return any(k in self.needed(0, h) for h in points if h > k)

    def kept_blocks(self, stop: int, prompt_tokens: int, retention_tokens: int) -> set[int]:
        """The blocks of ``[0, stop)`` :meth:`kept` keeps, all at once (ranges, not a
        question per block: the simulator saves whole traces)."""
        bs = self.block_size
        kept: set[int] = set()
        for h in {max(0, prompt_tokens - 1) // bs, prompt_tokens // bs}:
            kept.update(self.needed(0, h))
        every = retention_tokens // bs
        if every:
            # Block k's nearest point above is the multiple m of every with m - every <= k < m.
            for m in range(every, stop + every, every):
                kept.update(range(max(m - every, self.needed(0, m).start), m))
        return {k for k in kept if k < stop}


@dataclass(frozen=True)
class UnitRings:
    """A window group's blocks for a replay that moves ``unit`` blocks at a time
    (``kvc simulate``'s whole trace blocks), whose hits end at unit boundaries.

    A block is needed by the hits ending at the unit boundaries from just past it up
    to the last one whose window still reaches it: a *reach* of ``d`` units. Within
    a unit the reach grows with the block, so a unit's blocks fall into *rings*,
    runs of one reach (a sliding window: at most two, the window's tail r = n mod
    ``unit`` of its n blocks and the rest), and blocks of reach 0 (no hit at a unit
    boundary needs them) are in none. A ring is kept, looked up and evicted as
    one: the blocks a window needs are stored and looked up, not the unit's.
    The pattern repeats every ``period`` units (1 for a sliding window). Where
    every unit's end is a retained point, a tier keeps all of a unit's rings or
    none: they are then one ring (``whole``), one entry a unit.
    """

    #: The group's layout, of vLLM blocks.
    layout: GroupLayout
    unit: int
    period: int
    #: Per unit phase (unit mod ``period``): its rings, (first block in the unit, blocks, reach).
    rings: tuple[tuple[tuple[int, int, int], ...], ...]
    #: Per phase of a hit's end E: the rings it needs, (units back from E, ring of that unit).
    needs: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def sizes(self) -> set[int]:
        """Every ring's blocks."""
        return {size for phase in self.rings for _, size, _ in phase}

    @property
    def longest(self) -> int:
        """The longest reach, in units."""
        return max((d for phase in self.rings for _, _, d in phase), default=0)

    def kept(self, stop: int, every: int, ends: Sequence[int]) -> list[tuple[int, ...]]:
        """The rings a tier keeps of units ``[0, stop)`` (each unit's, by number): of the
        blocks :meth:`GroupLayout.kept` keeps (the windows before every ``every`` blocks
        and before ``ends``, the blocks where the prompt ends), the whole rings. The
        window before a unit's end is whole rings; a ring a window inside a unit covers
        only in part can serve no hit at a unit's end, and is not kept (nor are blocks
        of no ring: no hit at a unit's end needs them)."""
        unit, period, rings = self.unit, self.period, self.rings
        e = lcm(every, unit) // unit if every else 0  # units between retained boundaries
        memo: dict[tuple[int, int], tuple[int, ...]] = {}
        kept: list[tuple[int, ...]] = []
        if e == 1 and period == 1:  # every boundary retained: every ring (the default)
            kept = [tuple(range(len(rings[0])))] * stop
        for j in range(len(kept), stop):
            phase = (j % period, j % e if e else 0)
            got = memo.get(phase)
            if got is None:  # the next retained boundary is e - j % e units on
                reach = enumerate(rings[phase[0]])
                got = memo[phase] = tuple(i for i, (_, _, d) in reach if e and e - phase[1] <= d)
            kept.append(got)
        for first, end in self.spans(ends):
            for j in range(first // unit, min(-(-end // unit), stop)):
                at = j * unit
                more = {
                    i
                    for i, (lo, size, _) in enumerate(rings[j % period])
                    if first <= at + lo and at + lo + size <= end
                }
                if not more.issubset(kept[j]):
                    kept[j] = tuple(sorted(more.union(kept[j])))
        return kept

    def spans(self, ends: Sequence[int]) -> list[tuple[int, int]]:
        """The windows before ``ends`` (blocks where a prompt ends), ``[first, end)``
        ranges of blocks (one where they overlap)."""
        spans: list[tuple[int, int]] = []
        for first, end in sorted((self.layout.needed(0, p).start, p) for p in set(ends) if p):
            if spans and first <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
            else:
                spans.append((first, end))
        return spans

    def loose(self, ends: Sequence[int], kept: list[tuple[int, ...]], start: int, stop: int) -> int:
        """Blocks of ``[start, stop)`` in the windows before ``ends`` that no ring of ``kept``
        holds: the exact tier keeps them (before a point inside a unit, or inside a
        prompt's partial last unit), though no hit at a unit's end can use them."""
        unit, period, rings = self.unit, self.period, self.rings
        total = 0
        for first, end in self.spans(ends):
            first, end = max(first, start), min(end, stop)
            total += max(0, end - first)
            for j in range(first // unit, min(-(-end // unit), len(kept))):
                for i in kept[j]:
                    lo, size, _ = rings[j % period][i]
                    at = j * unit + lo
                    total -= max(0, min(at + size, end) - max(at, first))
        return total


def unit_rings(layout: GroupLayout, unit: int, whole: bool = False) -> UnitRings:
    """The :class:`UnitRings` of a window ``layout`` (of vLLM blocks) in units of ``unit``;
    ``whole``: a unit's rings as one (where a tier always keeps them together: a hit
    then touches the whole of its oldest unit's, not only the part it needs)."""
    tokens, window = unit * layout.block_size, layout.window
    period = window // gcd(window, tokens) if layout.kind == "chunked_local" and window else 1

    def reach(k: int, j: int) -> int:
        """Units past ``j`` whose boundary still needs block ``k`` of unit ``j``."""
        e = j + 1
        while layout.needed(0, e * unit).start <= k:
            e += 1
        return e - 1 - j

    rings = []
    for j in range(period):
        reaches = [reach(j * unit + o, j) for o in range(unit)]
        runs: list[tuple[int, int, int]] = []
        for o, d in enumerate(reaches):
            if not d:
                continue
            if runs and runs[-1][2] == d:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, d)
            else:
                runs.append((o, 1, d))
        if whole and runs:
            runs = [(runs[0][0], sum(n for _, n, _ in runs), max(d for _, _, d in runs))]
        rings.append(tuple(runs))
    longest = max((d for phase in rings for _, _, d in phase), default=0)
    needs = tuple(
        tuple(
            (back, i)
            for back in range(1, longest + 1)
            for i, (_, _, d) in enumerate(rings[(end - back) % period])
            if d >= back
        )
        for end in range(period)
    )
    return UnitRings(layout, unit, period, tuple(rings), needs)


@dataclass(frozen=True)
class BlockLayout:
    block_size: int  # tokens per block (of the groups the tier serves)
    slot_bytes: int  # bytes of one slot: one group's block (every layer when one group)
    groups: tuple[GroupLayout, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_kinds(self) -> tuple[str, ...]:
        return tuple(g.kind for g in self.groups)

    @property
    def unserved_kinds(self) -> tuple[str, ...]:
        return tuple(k for k in self.group_kinds if k not in SERVED_KINDS)

    @property
    def bundles(self) -> Bundles:
        return bundles(self.groups)


@dataclass(frozen=True)
class Bundles:
    """The groups of each layout (a bundle), in the order of each layout's first group:
    the groups whose blocks at one position the tier keeps, serves and evicts
    together (one index entry, one slot per group)."""

    members: tuple[tuple[int, ...], ...]
    #: Each bundle's layout.
    layouts: tuple[GroupLayout, ...]
    #: Each group's bundle and its place in it.
    of: tuple[tuple[int, int], ...]
    #: The bundles of full attention, and of a window or chunk.
    full: tuple[int, ...]
    window: tuple[int, ...]

    @property
    def largest(self) -> int:
        """Slots of the largest entry."""
        return max(len(m) for m in self.members)


def bundles(groups: Sequence[GroupLayout]) -> Bundles:
    """The :class:`Bundles` of a model's groups."""
    by_layout: dict[GroupLayout, list[int]] = {}
    for g, layout in enumerate(groups):
        by_layout.setdefault(layout, []).append(g)
    members = tuple(tuple(m) for m in by_layout.values())
    layouts = tuple(by_layout)
    of = {g: (b, i) for b, m in enumerate(members) for i, g in enumerate(m)}
    return Bundles(
        members,
        layouts,
        tuple(of[g] for g in range(len(groups))),
        tuple(b for b, x in enumerate(layouts) if x.kind == "attention"),
        tuple(b for b, x in enumerate(layouts) if x.window),
    )


def layout_from_kv_cache_config(kv_cache_config: Any) -> BlockLayout:
    """Tokens per block, bytes per slot and the groups of vLLM's ``KVCacheConfig``.

    One group: bytes per slot = for every ``KVCacheTensor``, its layers' pages
    (``kv_cache_spec.page_size_bytes``) — the bytes of row ``b`` of every
    canonical region. Several groups (hybrid manager): one group's block, i.e.
    its page times its layers, the largest over the groups.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("KV cache groups: KVCacheConfig has none")
    layouts = tuple(_group(group.kv_cache_spec) for group in groups)
    served = {g.block_size for g in layouts if g.kind in SERVED_KINDS}
    if len(served) > 1:
        raise ValueError(f"KV cache groups have different block sizes: {sorted(served)}")
    block_size = served.pop() if served else layouts[0].block_size
    if len(groups) > 1:
        slot = max(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in groups)
        return BlockLayout(block_size, slot, layouts)
    page_of = {name: int(groups[0].kv_cache_spec.page_size_bytes) for name in groups[0].layer_names}
    total = 0
    seen: set[str] = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        names = getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or ()
        for name in names:
            if name in page_of and name not in seen:
                seen.add(name)
                total += page_of[name]
    if total == 0:  # no tensor placement given: every layer
        total = sum(page_of.values())
    return BlockLayout(block_size, total, layouts)


def _group(spec: Any) -> GroupLayout:
    name = type(spec).__name__
    block_size = int(spec.block_size)
    # A FullAttentionSpec that records a sliding window keeps every block
    # (vLLM's non-hybrid manager), so only the class decides.
    if "SlidingWindow" in name:
        return GroupLayout("sliding_window", block_size, int(spec.sliding_window))
    if "ChunkedLocal" in name:
        return GroupLayout("chunked_local", block_size, int(spec.attention_chunk_size))
    if "Mamba" in name:
        return GroupLayout("mamba", block_size)
    if "Attention" in name:
        return GroupLayout("attention", block_size)
    return GroupLayout(name, block_size)
