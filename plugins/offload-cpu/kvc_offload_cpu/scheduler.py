"""The scheduler half: owns the index, answers lookups, plans loads and saves.

It runs in vLLM's EngineCore process and never touches KV bytes. With several
KV cache groups (vLLM's hybrid manager) each layout's blocks are indexed on
their own, a position's blocks of the groups of one layout as one entry (a
bundle: :func:`~kvc_offload_cpu.layout.bundles`): full attention keeps every
block, sliding-window and chunked-local layouts only the blocks a hit at a
retained point needs, and a hit is the longest prefix every group can serve
(vLLM's own rule). Every step it
tells the worker half, through :class:`~kvc_offload_cpu.metadata.OffloadMetadata`,
which slots to load into which blocks and which blocks to save into which
slots; the workers confirm through
:class:`~kvc_offload_cpu.metadata.OffloadWorkerMeta`. A block being saved is no
hit until every worker confirmed it; a slot with a pending load is pinned.
When vLLM publishes KV cache events, so does the tier (``take_events``: see
:mod:`kvc_offload_cpu.events`).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from composer import NULL_BLOCK, NodeContext, Plugin, Retention, hookimpl
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.events import TierEvents, vllm_events_enabled
from kvc_offload_cpu.index import BlockIndex, Entry
from kvc_offload_cpu.keys import RequestKeys
from kvc_offload_cpu.layout import GroupLayout, layout_from_kv_cache_config
from kvc_offload_cpu.metadata import OffloadMetadata, OffloadWorkerMeta, SlotGen, Transfer
from kvc_offload_cpu.policies import Admission, PolicyFallback


class TrackedRequest:
    __slots__ = (
        "view",
        "keys",
        "block_ids",
        "next_save",
        "save_end",
        "save_end_known",
        "foreign",
        "inflight",
        "lookup",
        "finished",
    )

    def __init__(self, view: Any, hash_ratio: int | None) -> None:
        self.view = view
        self.keys = RequestKeys(hash_ratio)
        self.block_ids: list[list[int]] = []
        #: Blocks below this index are stored, being stored, or skipped.
        self.next_save = 0
        #: Tokens it may save (its tier controls and the admission threshold; None:
        #: all), decided when its first save is planned.
        self.save_end: int | None = None
        self.save_end_known = False
        #: Token ranges other nodes loaded into it: (start, end).
        self.foreign: list[tuple[int, int]] = []
        #: Saves of this request not yet confirmed by every worker.
        self.inflight: set[SlotGen] = set()
        #: (num_computed_tokens, hit blocks) of the last lookup.
        self.lookup: tuple[int, int] | None = None
        self.finished = False


class _PendingSave:
    __slots__ = ("entry", "req", "confirmations", "order")

    def __init__(self, entry: Entry, req: TrackedRequest, order: int) -> None:
        self.entry = entry
        self.req = req
        self.confirmations = 0
        #: When it was planned: saves become ready in this order.
        self.order = order


class _PendingLoad:
    __slots__ = ("entries", "confirmations")

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.confirmations = 0


class SchedulerHalf(Plugin[OffloadCPUConfig]):
    """The ``offload-cpu`` node in vLLM's scheduler process."""

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        if ctx.kv_cache_config is None:
            raise ValueError("offload-cpu: the scheduler half needs vLLM's KVCacheConfig")
        config, stats, log = self.config, self.stats, self.log
        self.layout = layout = layout_from_kv_cache_config(ctx.kv_cache_config)
        self.block_size = layout.block_size
        self.num_workers = _num_workers(ctx.vllm_config)
        self.serves = ctx.role in ("load", "both")
        self.saves = ctx.role in ("save", "both")
        self.num_slots = int(config.capacity) // layout.slot_bytes if layout.slot_bytes else 0
        self.index = BlockIndex(
            self.num_slots, config.eviction, config, config.retention, quotas=config.quotas
        )
        self.admission = Admission(config.admission, self.num_slots, config, self.index.health)
        # The policies in force on the node's stats (and /metrics) from the start; a
        # policy that raises is switched off and said there (_policy_switched).
        self.index.health.on_fallback = self._policy_switched
        stats.policies.update(self.index.health.in_force())
        self.bundles = layout.bundles
        largest = self.bundles.largest
        self.disabled_reason: str | None = None
        if layout.unserved_kinds:
            model = getattr(getattr(ctx.vllm_config, "model_config", None), "model", "?")
            self.disabled_reason = (
                f"model {model} has {'/'.join(sorted(set(layout.unserved_kinds)))} KV cache "
                "groups: their recurrent state is not restorable from blocks (vLLM keeps no "
                "per-block state snapshots here), so this node serves no hits for it; "
                "tokens are computed as without the tier"
            )
        elif self.num_slots < largest:
            self.disabled_reason = (
                f"capacity {config.capacity.human_readable()} holds no {largest} blocks "
                f"of {layout.slot_bytes} bytes (one position of {largest} KV cache groups)"
                if largest > 1
                else f"capacity {config.capacity.human_readable()} holds no block "
                f"of {layout.slot_bytes} bytes"
            )
        if self.disabled_reason:
            log.warning("offload-cpu disabled", reason=self.disabled_reason)
            stats.disabled = True
        hash_block_size = getattr(ctx.kv_cache_config, "hash_block_size", None) or self.block_size
        self.hash_ratio = (
            self.block_size // hash_block_size if self.block_size % hash_block_size == 0 else None
        )
        self._reqs: dict[str, TrackedRequest] = {}
        self._saving: dict[SlotGen, _PendingSave] = {}
        self._planned = itertools.count()
        self._loading: dict[str, deque[_PendingLoad]] = {}
        self._pending_loads: list[Transfer] = []
        self._pending_hold: list[str] = []
        self._evictions_seen = 0
        self._tenant_evictions_seen: dict[str, int] = {}
        self.events = self._make_events(ctx)
        log.info(
            "offload-cpu scheduler",
            slots=self.num_slots,
            slot_bytes=layout.slot_bytes,
            block_size=self.block_size,
            groups=",".join(layout.group_kinds),
            vllm_hashes=self.hash_ratio is not None,
            kv_events=self.events is not None,
            policies=", ".join(f"{k} {v}" for k, v in self.index.health.in_force().items()),
        )

    def _policy_switched(self, fallback: PolicyFallback) -> None:
        """A cache policy raised and was switched off (the index logged it): counted
        (``policy_fallbacks``), and the policy in force reported on the node's stats."""
        self.stats.extra.add("policy_fallbacks")
        self.stats.policies[fallback.kind] = fallback.in_force

    def _make_events(self, ctx: NodeContext) -> TierEvents | None:
        """The tier's KV cache events, when asked for and vLLM publishes them."""
        vllm_publishes = vllm_events_enabled(ctx.vllm_config)
        if not self.config.events or vllm_publishes is False:
            return None  # nothing is built, and take_events is not even called
        if not self.saves or self.disabled_reason:
            return None  # the tier never holds a block
        if self.hash_ratio is None:
            self.log.warning(
                "offload-cpu publishes no KV cache events: vLLM's hash block size "
                "does not divide the block size",
                block_size=self.block_size,
            )
            return None
        events = TierEvents(ctx.kv_cache_config, self.block_size, self.hash_ratio)
        self.index.on_remove = self._removed
        return events

    def direct_hooks(self) -> dict[str, Any]:
        # Events off: the chain leaves the node out of these altogether (they would
        # do nothing), so the tier costs nothing per step for them; a subclass's
        # own take_events or shutdown stays.
        if self.events is not None:
            return {}
        return {
            hook: None
            for hook in ("take_events", "shutdown")
            if getattr(type(self), hook) is getattr(SchedulerHalf, hook)
        }

    # -- keys and groups ------------------------------------------------------ #

    def _key(self, tracked: TrackedRequest, bundle: int, k: int) -> bytes:
        """Index key of block ``k`` of ``bundle`` (the block key alone with one bundle)."""
        key = tracked.keys.keys[k]
        return key if len(self.bundles.members) == 1 else key + bytes((bundle,))

    def _ready(self, tracked: TrackedRequest, bundle: int, positions: range) -> bool:
        return all(self.index.ready(self._key(tracked, bundle, k)) is not None for k in positions)

    def _kept(self, tracked: TrackedRequest, bundle: int, k: int) -> bool:
        """Whether block ``k`` of a windowed bundle is saved (:meth:`GroupLayout.kept`)."""
        spec: GroupLayout = self.bundles.layouts[bundle]
        return spec.kept(k, tracked.view.num_prompt_tokens, self.config.window_retention)

    # -- requests ------------------------------------------------------------ #

    def _req(self, request: Any) -> TrackedRequest:
        tracked = self._reqs.get(request.request_id)
        if tracked is None or tracked.finished:
            tracked = TrackedRequest(request, self.hash_ratio)
            self._reqs[request.request_id] = tracked
        else:
            tracked.view = request
        return tracked

    @hookimpl
    def on_new_request(self, request: Any) -> None:
        self._req(request)
        quotas = self.index.quotas
        if quotas is not None and self._involved(request):  # the tenants quotas name
            tenant = quotas.of(request.tenant)
            self.stats.tenant_add("requests", tenant)
            self.stats.tenant_add("prompt_tokens", tenant, request.num_prompt_tokens)

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.serves or self.disabled_reason:
            return 0, False
        tracked = self._req(request)
        bs = self.block_size
        # Leave at least one token to compute; only whole blocks are served.
        max_blocks = max(0, request.num_tokens - 1) // bs
        start = num_computed_tokens // bs
        hit = 0
        if num_computed_tokens % bs == 0 and start < max_blocks:
            end = start
            available = tracked.keys.ensure(request, max_blocks, bs)
            # Full attention: the longest run of stored blocks.
            while end < available and all(
                self.index.ready(self._key(tracked, b, end)) is not None for b in self.bundles.full
            ):
                end += 1
            # Windowed layouts: the longest of those ends whose window they hold.
            while end > start and not all(
                self._ready(tracked, b, self.bundles.layouts[b].needed(start, end))
                for b in self.bundles.window
            ):
                end -= 1
            hit = end - start
        if hit < self.config.min_blocks:
            hit = 0
        tracked.lookup = (num_computed_tokens, hit)
        return hit * bs, hit > 0 and self.config.load_mode == "async"

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        tracked = self._req(request)
        tracked.block_ids = [list(ids) for ids in block_ids]
        loads = getattr(request, "loads", ())
        if loads:
            # (vLLM allocates an async-loaded request again, with nothing to load:
            # what other nodes loaded into it stays known.)
            tracked.foreign = [
                (r.start, r.start + r.tokens) for r in loads if r.node != self.node_id
            ]
        if num_external_tokens == 0:
            if tracked.lookup is not None:  # first allocation of a request we looked up
                self.stats.extra.add("misses")
                tracked.lookup = None
            return
        bs = self.block_size
        computed = tracked.lookup[0] if tracked.lookup is not None else 0
        tracked.lookup = None
        if self.index.quotas is not None:
            tenant = self.index.quotas.of(tracked.view.tenant)
            self.stats.tenant_add("tokens_hit", tenant, num_external_tokens)
        start, n = computed // bs, num_external_tokens // bs
        # (lookups, hits and what was served are the chain's counts, for every node)
        transfer = Transfer(request.request_id)
        entries: list[Entry] = []
        # Every block vLLM allocated for the hit is loaded: positions outside a
        # window hold the null block, and nothing is loaded there.
        for g, ids in enumerate(block_ids):
            b, i = self.bundles.of[g]
            for k in range(start, min(start + n, len(ids))):
                if ids[k] == NULL_BLOCK:
                    continue
                key = self._key(tracked, b, k) if k < len(tracked.keys.keys) else None
                entry = self.index.ready(key) if key is not None else None
                if entry is None:  # cannot happen between lookup and alloc; fail it safely
                    transfer.add(-1, -1, ids[k], g, k)
                    continue
                self.index.pin(entry)  # once per group: each group's load unpins it
                self.index.touch(entry)
                entries.append(entry)
                transfer.add(entry.slots[i], entry.gen, ids[k], g, k)
        # Saving skips the loaded blocks by key (they are in the index).
        self._loading.setdefault(request.request_id, deque()).append(_PendingLoad(entries))
        self._pending_loads.append(transfer)

    @hookimpl
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            return False, None
        tracked.finished = True
        retention = tracked.view.controls.retention
        params = None
        if retention is not None and self._involved(tracked.view):
            params = self._retain(tracked, retention)
        hold = bool(tracked.inflight) and self.config.save_mode == "async"
        if hold:
            self._pending_hold.append(request.request_id)
        else:
            self._forget(tracked)
        return hold, params

    def _involved(self, request: Any) -> bool:
        """Whether ``request`` (a :class:`composer.RequestView`) may load from or save to
        this tier (its tier controls): only then do its retention and its tenant's
        figures concern it."""
        controls = request.controls
        loads = controls.load is None or self.node_id in controls.load
        return loads or controls.store_limit(self.node_id) != 0

    def _retain(self, tracked: TrackedRequest, retention: Retention) -> dict[str, Any] | None:
        """The request's ``kv_retention`` for each of its blocks this tier holds (its last
        use is now); a pin not granted is counted, logged and said in the request's
        ``kv_transfer_params`` (``kv_composer.retention.<node>``)."""
        refused = asked = 0
        for b in range(len(self.bundles.members) if tracked.block_ids else 0):
            for k in range(len(tracked.keys.keys)):
                entry = self.index.get(self._key(tracked, b, k))
                if entry is not None:  # (counted in blocks: an entry's slots)
                    asked += entry.size
                    refused += 0 if self.index.retain(entry, retention) else entry.size
        if not (refused and retention.pin):
            return None
        self.stats.extra.add("pins_refused", refused)
        reason = (
            f"pin not granted for {refused} of {asked} blocks: max_pinned_share "
            f"{self.config.max_pinned_share} of the tier is pinned"
        )
        self.log.warning("kv_retention " + reason, request=tracked.view.request_id)
        return {"kv_composer": {"retention": {self.node_id: reason}}}

    def _forget(self, tracked: TrackedRequest) -> None:
        rid = tracked.view.request_id
        if self._reqs.get(rid) is tracked:
            del self._reqs[rid]

    # -- steps --------------------------------------------------------------- #

    @hookimpl
    def build_connector_meta(self, step: Any) -> OffloadMetadata:
        meta = OffloadMetadata(
            loads=self._pending_loads,
            hold=self._pending_hold,
            preempted=sorted(step.preempted_request_ids),
            async_loads=self.config.load_mode == "async",
        )
        self._pending_loads = []
        self._pending_hold = []
        for sched in step.requests:
            tracked = self._reqs.get(sched.request_id)
            if tracked is None:
                continue
            if sched.block_ids is not None:
                if sched.is_new or sched.resumed or not tracked.block_ids:
                    tracked.block_ids = [list(ids) for ids in sched.block_ids]
                else:
                    for g, ids in enumerate(sched.block_ids):
                        tracked.block_ids[g].extend(ids)
            if self.saves and not self.disabled_reason:
                self._plan_saves(tracked, sched, meta)
        self._update_gauges()
        return meta

    def _plan_saves(self, tracked: TrackedRequest, sched: Any, meta: OffloadMetadata) -> None:
        view = tracked.view
        if not tracked.save_end_known:
            tracked.save_end, tracked.save_end_known = self._save_end(tracked), True
        done = min(sched.num_computed_tokens + sched.num_scheduled_tokens, view.num_tokens)
        if self.config.save == "prompt":
            done = min(done, view.num_prompt_tokens)
        if tracked.save_end is not None:
            done = min(done, tracked.save_end)
        full = min(done // self.block_size, min((len(ids) for ids in tracked.block_ids), default=0))
        if full <= tracked.next_save:
            return
        available = tracked.keys.ensure(view, full, self.block_size)
        # A windowed group frees blocks that leave its window while the request
        # runs: only blocks computed in this step are surely still its own.
        fresh = sched.num_computed_tokens // self.block_size
        k = tracked.next_save
        bs, never = self.block_size, self.config.promote == "never"
        planned: list[tuple[Entry, int, int, bool]] = []  # (entry, bundle, position, foreign)
        while k < available:
            foreign = any(a <= k * bs and (k + 1) * bs <= b for a, b in tracked.foreign)
            if foreign and never:
                k += 1  # loaded by another node: not promoted here
                continue
            for b, members in enumerate(self.bundles.members):
                if any(tracked.block_ids[g][k] == NULL_BLOCK for g in members) or (
                    b in self.bundles.window and (k < fresh or not self._kept(tracked, b, k))
                ):
                    continue
                key = self._key(tracked, b, k)
                known = self.index.get(key)
                if known is not None:  # stored or being stored (maybe by another request)
                    self.index.touch(known)
                    continue
                entry = self.index.allocate(key, view.tenant, len(members))
                if entry is None:  # every slot pinned or in flight: try again next step
                    self.stats.extra.add("save_skipped_full")
                    tracked.next_save = k
                    self._plan_batch(tracked, planned, meta)
                    return
                planned.append((entry, b, k, foreign))
            k += 1
        tracked.next_save = k
        self._plan_batch(tracked, planned, meta)

    def _plan_batch(
        self,
        tracked: TrackedRequest,
        planned: list[tuple[Entry, int, int, bool]],
        meta: OffloadMetadata,
    ) -> None:
        """The copies of a request's new entries this step, once their slots are dealt
        bundle by bundle (:meth:`~kvc_offload_cpu.slots.NumberedSlots.deal`: each
        bundle's blocks in a run of slots, for the copies now and the batches that
        reuse the slots when they go)."""
        if not planned:
            return
        by_bundle: list[list[Entry]] = [[] for _ in self.bundles.members]
        for entry, b, _, _ in planned:
            by_bundle[b].append(entry)
        self.index.deal(by_bundle)
        transfer = Transfer(tracked.view.request_id)
        meta.saves.append(transfer)
        for entry, b, k, foreign in planned:
            members = self.bundles.members[b]
            self._plan_save(tracked, entry, members, k, transfer)
            if foreign:
                self.stats.extra.add("blocks_promoted", len(members))

    def _plan_save(
        self,
        tracked: TrackedRequest,
        entry: Entry,
        members: tuple[int, ...],
        k: int,
        transfer: Transfer,
    ) -> None:
        """Block ``k`` of each group of a bundle into its slot of ``entry``: ready once
        every worker confirmed every slot."""
        pending = _PendingSave(entry, tracked, next(self._planned))
        for i, g in enumerate(members):
            transfer.add(entry.slots[i], entry.gen, tracked.block_ids[g][k], g, k)
            sg = (entry.slots[i], entry.gen)
            self._saving[sg] = pending
            tracked.inflight.add(sg)
        if self.events is not None:  # vLLM's payloads, while the request is here
            entry.event = [self.events.block_stored(tracked.view, g, k) for g in members]

    def _save_end(self, tracked: TrackedRequest) -> int | None:
        """Tokens of the request this tier may save: its tier controls
        (``kv_store_tiers``, ``max_offload_tokens``), and the leading blocks of its
        prompt the admission policy admits (``threshold``: those enough requests
        contained, this one counted)."""
        view = tracked.view
        end = view.store_limit(self.node_id)
        if end == 0:
            return end
        bs = self.block_size
        blocks = tracked.keys.ensure(view, view.num_prompt_tokens // bs, bs)
        admitted = self.admission.admit(tracked.keys.keys[:blocks])
        if admitted < blocks:
            self.stats.extra.add("blocks_not_admitted", blocks - admitted)
            end = admitted * bs if end is None else min(end, admitted * bs)
        return end

    @hookimpl
    def update_connector_output(self, worker_meta: OffloadWorkerMeta | None) -> None:
        if worker_meta is None:
            return
        done: dict[int, _PendingSave] = {}
        for sg, n in worker_meta.saved.items():
            pending = self._saving.get(sg)
            if pending is None:
                continue
            pending.confirmations += n
            if pending.confirmations >= self.num_workers * len(pending.entry.slots):
                done[pending.order] = pending
        # Ready in the order they were planned (position by position, as kvc simulate's
        # model), not the workers' (group by group): the eviction policy sees that order.
        for _, pending in sorted(done.items()):
            self.index.mark_ready(pending.entry)
            if self.events is not None and pending.entry.ready:
                self._stored(pending.entry)
            self._save_resolved(pending)
        for sg in worker_meta.save_failed:
            pending = self._saving.get(sg)
            if pending is not None:
                self.index.drop(pending.entry)
                self._save_resolved(pending)
        for rid, n in worker_meta.loaded.items():
            queue = self._loading.get(rid)
            while queue and n > 0:
                take = min(n, self.num_workers - queue[0].confirmations)
                queue[0].confirmations += take
                n -= take
                if queue[0].confirmations >= self.num_workers:
                    for pinned in queue.popleft().entries:
                        self.index.unpin(pinned)
            if queue is not None and not queue:
                del self._loading[rid]
        for slot, gen in worker_meta.load_failed:
            bad = self.index.current(slot, gen)
            if bad is not None:
                self.index.drop(bad)
                self.stats.extra.add("dropped_bad_blocks")
        for rid, position in worker_meta.req_load_failed.items():
            tracked = self._reqs.get(rid)
            if tracked is not None:  # vLLM recomputes from there: save those blocks again
                tracked.next_save = min(tracked.next_save, position)
        self._update_gauges()

    def _save_resolved(self, pending: _PendingSave) -> None:
        """The entry's save is over (every slot saved, or one failed)."""
        tracked = pending.req
        for slot in pending.entry.slots:
            sg = (slot, pending.entry.gen)
            self._saving.pop(sg, None)
            tracked.inflight.discard(sg)
        if tracked.finished and not tracked.inflight:
            self._forget(tracked)

    @hookimpl
    def reset_cache(self) -> bool:
        dropped = self.index.reset()  # each dropped block's BlockRemoved is queued
        self.log.info("offload-cpu reset", dropped=dropped)
        return True

    # -- KV cache events ------------------------------------------------------- #

    def _stored(self, entry: Entry) -> None:
        """An entry every worker saved: announce its groups' blocks (their payloads were
        captured at planning)."""
        assert self.events is not None
        payloads = entry.event or []
        if None in payloads and not self.events.warned:  # vLLM had no hash: not announced
            self.events.warned = True
            self.log.warning("offload-cpu: a block without vLLM's block hash is not published")
        entry.event = [self.events.announce(p) for p in payloads if p is not None]

    def _removed(self, entry: Entry) -> None:
        """``BlockIndex.on_remove``: an entry whose blocks were announced left the tier."""
        if entry.ready and entry.event:
            assert self.events is not None
            for announced in entry.event:
                self.events.remove(announced)
        entry.event = None

    @hookimpl
    def take_events(self) -> list[Any]:
        """vLLM's ``BlockStored``/``BlockRemoved`` (medium CPU) since the last step."""
        # (The chain counts them on the node's stats, as every node's.)
        return [] if self.events is None else self.events.take()

    @hookimpl
    def shutdown(self) -> None:
        """The tier empties: every block it announced is removed (published if the
        chain still takes this node's events)."""
        if self.events is None:
            return
        for entry in self.index.entries():
            self._removed(entry)

    def _update_gauges(self) -> None:
        new = self.index.evictions - self._evictions_seen
        if new:
            self.stats.extra.add("evictions", new)
            self._evictions_seen = self.index.evictions
        gauges = self.stats.gauges
        gauges["pool_slots"] = self.num_slots
        gauges["pool_slots_used"] = self.index.used_slots
        gauges["pool_bytes_used"] = self.index.used_slots * self.layout.slot_bytes
        gauges["pool_use"] = self.index.used_slots / self.num_slots if self.num_slots else 0.0
        quotas = self.index.quotas
        if quotas is not None:
            seen = self._tenant_evictions_seen
            for tenant, evicted in quotas.evicted.items():
                if evicted > seen.get(tenant, 0):
                    self.stats.tenant_add("blocks_evicted", tenant, evicted - seen.get(tenant, 0))
                    seen[tenant] = evicted
            for tenant, limit in quotas.limit.items():
                self.stats.tenant_gauges[f"blocks_held:{tenant}"] = quotas.held[tenant]
                self.stats.tenant_gauges[f"blocks_quota:{tenant}"] = limit


def _num_workers(vllm_config: Any) -> int:
    """Workers whose confirmations a save needs (each holds its own shard of every block)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return 1
    return int(getattr(parallel, "world_size", 1) or 1)
