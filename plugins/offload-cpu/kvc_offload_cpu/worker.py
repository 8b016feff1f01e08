"""The worker half: the host pool and the copies, driven by the scheduler's metadata.

Runs in each vLLM worker process. Loads (sync mode) run in ``start_load_kv``,
before any layer of the forward; saves are submitted in ``wait_for_save``,
after the forward computed the blocks, and run on a background thread (or
inline with ``save_mode: sync``). Results travel back to the scheduler half in
:class:`~kvc_offload_cpu.metadata.OffloadWorkerMeta`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from composer import CanonicalKVCaches, NodeContext, Plugin, hookimpl
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.datapath import HostPool, RegionPlan
from kvc_offload_cpu.layout import BlockLayout, layout_from_kv_cache_config
from kvc_offload_cpu.memory import check_pool_fits
from kvc_offload_cpu.metadata import OffloadMetadata, OffloadWorkerMeta, Transfer

GiB = float(1 << 30)


@dataclass
class _SaveResult:
    slots: list[int]
    gens: list[int]
    block_ids: list[int]
    groups: list[int]
    req_ids: list[str]  # each request once
    seconds: float = 0.0
    error: BaseException | None = None

    def add(self, slot: int, gen: int, block_id: int, group: int, req_id: str) -> None:
        self.slots.append(slot)
        self.gens.append(gen)
        self.block_ids.append(block_id)
        self.groups.append(group)
        if not self.req_ids or self.req_ids[-1] != req_id:
            self.req_ids.append(req_id)


@dataclass
class _LoadResult:
    transfers: list[Transfer]
    ok: list[bool] = field(default_factory=list)  # per block, in transfer order
    stale: list[bool] = field(default_factory=list)  # slot overwritten / never written
    seconds: float = 0.0
    error: BaseException | None = None


class WorkerHalf(Plugin[OffloadCPUConfig]):
    """The ``offload-cpu`` node in each vLLM worker process."""

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        layout = None
        if ctx.kv_cache_config is not None:
            layout = layout_from_kv_cache_config(ctx.kv_cache_config)
        self.layout: BlockLayout | None = layout
        self.pool: HostPool | None = None
        self.block_size = layout.block_size if layout else 0
        self._slot_gen: list[int] = []
        #: Blocks loaded into vLLM, and blocks refused at load (checksum, stale
        #: slot, error), since start: stats report deltas, these never reset.
        self.blocks_loaded = 0
        self.blocks_refused = 0
        self._meta: OffloadMetadata | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[tuple[Future[Any], Callable[[Any], None]]] = []
        self._wmeta = OffloadWorkerMeta()
        self._load_errors: set[int] = set()
        self._step_failed: set[str] = set()
        self._held: set[str] = set()
        self._inflight: dict[str, int] = {}
        self._recving: set[str] = set()
        self._recving_done: set[str] = set()

    # -- setup --------------------------------------------------------------- #

    @staticmethod
    def _plans(kv_caches: CanonicalKVCaches) -> list[RegionPlan]:
        # One plan per region any group uses; with vLLM's hybrid manager every
        # group's blocks live in the same regions, so a slot holds one group's block.
        users: dict[int, set[int]] = {}
        for group in kv_caches.groups:
            for rid in group.region_ids:
                users.setdefault(rid, set()).add(group.group_id)
        plans: list[RegionPlan] = []
        offset = 0
        for rid in sorted(users):
            region = kv_caches.regions[rid].tensor
            plans.append(RegionPlan(frozenset(users[rid]), region, offset, int(region.shape[1])))
            offset += int(region.shape[1])
        return plans

    @hookimpl
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        plans = self._plans(kv_caches)
        slot_bytes = sum(p.width for p in plans)
        #: Groups whose blocks vLLM frees while the request runs (windows): their
        #: saves finish inside wait_for_save, before a later step can reuse a block.
        self._inline_groups = frozenset(
            g for g, x in enumerate(self.layout.groups if self.layout else ()) if x.window
        )
        if self.layout is not None:
            # Same slot count as the scheduler half (it computed it from the same config).
            num_slots = int(self.config.capacity) // self.layout.slot_bytes
            if self.layout.slot_bytes != slot_bytes:
                self.log.warning(
                    "offload-cpu: KVCacheConfig bytes per block differ from the canonical view",
                    kv_cache_config=self.layout.slot_bytes,
                    canonical=slot_bytes,
                )
        else:
            num_slots = int(self.config.capacity) // slot_bytes if slot_bytes else 0
        if not self.block_size:
            self.block_size = kv_caches.groups[0].block_size if kv_caches.groups else 0
        device = plans[0].region.device if plans else torch.device("cpu")
        check_pool_fits(self.node_id, int(self.config.capacity), num_slots * slot_bytes)
        # (Pageable where pinning is refused: said once on the log, never a failed start.)
        self.pool = HostPool(plans, num_slots, pin=self._pins(device), log=self.log)
        self._slot_gen = [0] * num_slots
        if self.config.save_mode == "async" or self.config.load_mode == "async":
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvc-offload-cpu")
        if not self.pool.pinned:
            # Map the pool's pages on a thread of its own, lowest slots first (where
            # the index allocates). Saves and loads never queue behind it: a 4 GiB
            # pool took ~6 s, and a request's blocks stayed held meanwhile.
            self.pool.start_prefault(self._prefaulted)
        self.stats.gauges["pool_bytes"] = self.pool.nbytes
        self.log.info(
            "offload-cpu worker pool",
            slots=num_slots,
            slot_bytes=slot_bytes,
            regions=len(plans),
            pool_gib=round(self.pool.nbytes / GiB, 3),
            pinned=self.pool.pinned,
            device=str(device),
        )

    @staticmethod
    def _pins(device: torch.device) -> bool:
        """Whether the pool is pinned: for copies to and from a GPU (DMA, asynchronous)."""
        return device.type == "cuda" and torch.cuda.is_available()

    # -- sleep mode ----------------------------------------------------------- #

    @hookimpl
    def unregister_kv_caches(self) -> None:
        # vLLM releases its KV memory once this returns: every copy that reads or
        # writes it finishes first, and the pool lets go of it. What the pool
        # holds stays valid: the scheduler half's index still serves it.
        self.drain()
        if self.pool is not None:
            self.pool.detach()

    @hookimpl
    def restore_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        if self.pool is not None:
            self.pool.attach([p.region for p in self._plans(kv_caches)])

    # -- per step ------------------------------------------------------------ #

    @hookimpl
    def bind_connector_metadata(self, metadata: OffloadMetadata | None) -> None:
        self._meta = metadata
        self._step_failed = set()
        if metadata is not None:
            self._held.update(metadata.hold)

    @hookimpl
    def clear_connector_metadata(self) -> None:
        self._meta = None

    @hookimpl
    def handle_preemptions(self, metadata: OffloadMetadata | None) -> None:
        # A preempted request's blocks are reused right away: finish reading them first.
        if metadata is not None and metadata.preempted:
            self.drain()

    @hookimpl
    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads or self.pool is None:
            return
        transfers = meta.loads
        if meta.async_loads and self._executor is not None:
            for t in transfers:
                self._recving.add(t.req_id)
            fut = self._executor.submit(self._load, transfers)
            self._futures.append((fut, self._finish_load))
        else:
            self._finish_load(self._load(transfers))

    @hookimpl
    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or not meta.saves or self.pool is None:
            return
        inline = _SaveResult([], [], [], [], [])
        later = _SaveResult([], [], [], [], [])
        for t in meta.saves:
            if t.req_id in self._step_failed:
                # Its blocks were computed over a failed load this step: never store them.
                self._wmeta.save_failed.update(zip(t.slots, t.gens, strict=True))
                continue
            for i, g in enumerate(t.groups):
                part = inline if g in self._inline_groups else later
                part.add(t.slots[i], t.gens[i], t.block_ids[i], g, t.req_id)
        for part in (inline, later):
            for s in part.slots:
                self._slot_gen[s] = -1  # being written: no load may read it
            for rid in part.req_ids:
                self._inflight[rid] = self._inflight.get(rid, 0) + 1
        if inline.slots:
            self._finish_save(self._save(inline, None))
        if not later.slots:
            return
        if self.config.save_mode == "async" and self._executor is not None:
            event = None
            if self.pool.device.type == "cuda":  # pragma: no cover - needs a GPU
                event = torch.cuda.Event()
                event.record()
            fut = self._executor.submit(self._save, later, event)
            self._futures.append((fut, self._finish_save))
        else:
            self._finish_save(self._save(later, None))

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._collect()
        sending = {rid for rid in self._held if not self._inflight.get(rid)}
        self._held -= sending
        recving, self._recving_done = self._recving_done, set()
        return sending or None, recving or None

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        self._collect()
        errors, self._load_errors = self._load_errors, set()
        return errors

    @hookimpl
    def build_connector_worker_meta(self) -> OffloadWorkerMeta | None:
        self._collect()
        out, self._wmeta = self._wmeta, OffloadWorkerMeta()
        return None if out.is_empty() else out

    def drain(self) -> None:
        """Wait for every background copy and fold its results in."""
        for fut, _ in list(self._futures):
            fut.exception()
        self._collect()

    @hookimpl
    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.stop_prefault()
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- copies (maybe on the background thread) ----------------------------- #

    def _prefaulted(self, seconds: float | None, error: BaseException | None) -> None:
        """Called on the prefault thread when it ends."""
        pool = self.pool
        assert pool is not None
        mapped_gib = round(pool.faulted_slots * pool.slot_bytes / GiB, 3)
        if error is not None:  # only slower first saves into each slot
            self.log.warning(
                "offload-cpu: pool prefault failed", error=repr(error), mapped_gib=mapped_gib
            )
        elif pool.faulted_slots < pool.num_slots:  # shutdown came first
            self.log.info("offload-cpu pool prefault stopped", mapped_gib=mapped_gib)
        elif seconds is not None:
            self.log.info("offload-cpu pool prefaulted", seconds=round(seconds, 3))

    def _save(self, result: _SaveResult, event: Any) -> _SaveResult:
        assert self.pool is not None
        try:
            result.seconds = self.pool.save(
                result.slots,
                result.block_ids,
                result.groups,
                with_checksums=self.config.checksums,
                ready_event=event,
            )
            for s, g in zip(result.slots, result.gens, strict=True):
                self._slot_gen[s] = g
        except BaseException as exc:  # reported as failed saves, never raised into vLLM
            result.error = exc
        return result

    def _load(self, transfers: list[Transfer]) -> _LoadResult:
        assert self.pool is not None
        result = _LoadResult(transfers)
        slots: list[int] = []
        ids: list[int] = []
        groups: list[int] = []
        for t in transfers:
            for i, (s, g) in enumerate(zip(t.slots, t.gens, strict=True)):
                stale = not (0 <= s < len(self._slot_gen)) or self._slot_gen[s] != g
                result.stale.append(stale)
                if not stale:
                    slots.append(s)
                    ids.append(t.block_ids[i])
                    groups.append(t.groups[i])
        try:
            ok: list[bool] = []
            if slots:
                ok, result.seconds = self.pool.load(
                    slots, ids, groups, verify=self.config.checksums
                )
            it = iter(ok)
            result.ok = [False if stale else next(it) for stale in result.stale]
        except BaseException as exc:
            result.error = exc
            result.ok = [False] * len(result.stale)
        return result

    # -- results (main thread) ----------------------------------------------- #

    def _collect(self) -> None:
        while self._futures and self._futures[0][0].done():
            fut, finish = self._futures.pop(0)
            finish(fut.result())

    def _finish_save(self, result: _SaveResult) -> None:
        for rid in result.req_ids:
            left = self._inflight.get(rid, 0) - 1
            if left > 0:
                self._inflight[rid] = left
            else:
                self._inflight.pop(rid, None)
        pairs = list(zip(result.slots, result.gens, strict=True))
        if result.error is not None:
            self.log.error("offload-cpu save failed", error=repr(result.error), blocks=len(pairs))
            self.stats.errors += 1
            self._wmeta.save_failed.update(pairs)
            return
        for sg in pairs:
            self._wmeta.saved[sg] = self._wmeta.saved.get(sg, 0) + 1
        assert self.pool is not None
        n = len(pairs)
        self.stats.tokens_saved += n * self.block_size
        self.stats.bytes_saved += n * self.pool.slot_bytes
        self._add_time("save", result.seconds, self.stats.bytes_saved)

    def _finish_load(self, result: _LoadResult) -> None:
        assert self.pool is not None
        if result.error is not None:
            self.log.error("offload-cpu load failed", error=repr(result.error))
            self.stats.errors += 1
        i = 0
        good = 0
        #: Per request, the token positions loaded (one block of each group per position).
        loaded: dict[str, set[int]] = {}
        for t in result.transfers:
            self._wmeta.loaded[t.req_id] = self._wmeta.loaded.get(t.req_id, 0) + 1
            self._recving_done_add(t.req_id)
            for j in range(len(t)):
                if result.ok[i]:
                    good += 1
                    loaded.setdefault(t.req_id, set()).add(t.positions[j])
                else:
                    self._load_errors.add(t.block_ids[j])
                    self._step_failed.add(t.req_id)
                    pos = t.positions[j]
                    old = self._wmeta.req_load_failed.get(t.req_id)
                    self._wmeta.req_load_failed[t.req_id] = pos if old is None else min(old, pos)
                    kind = "stale_slot_loads" if result.stale[i] else "checksum_failures"
                    if result.error is not None:
                        kind = "load_exceptions"
                    if not result.stale[i]:  # corrupt data in a live slot: drop it
                        self._wmeta.load_failed.add((t.slots[j], t.gens[j]))
                    self.stats.extra.add(kind)
                    self.stats.extra.add("load_errors")
                i += 1
        # vLLM recomputes a request from its first failed block on: what arrived
        # is what lies before it (blocks copied after it are overwritten).
        failed_at = self._wmeta.req_load_failed
        positions = sum(
            sum(1 for p in done if p < failed_at.get(rid, p + 1)) for rid, done in loaded.items()
        )
        bad = i - good
        self.blocks_loaded += good
        self.blocks_refused += bad
        if bad:
            self.stats.errors += bad
            self.log.warning("offload-cpu: blocks failed to load; vLLM recomputes them", blocks=bad)
        self.stats.tokens_loaded += positions * self.block_size
        self.stats.bytes_loaded += good * self.pool.slot_bytes
        self._add_time("load", result.seconds, self.stats.bytes_loaded)

    def _recving_done_add(self, rid: str) -> None:
        if rid in self._recving:
            self._recving.discard(rid)
            self._recving_done.add(rid)

    def _add_time(self, what: str, seconds: float, total_bytes: int) -> None:
        extra = self.stats.extra
        key = f"{what}_copy_s"
        extra.add(key, seconds)
        if extra[key] > 0:  # throughput since the last report
            self.stats.gauges[f"{what}_gib_s"] = total_bytes / extra[key] / GiB
