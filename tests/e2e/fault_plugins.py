"""Fault injection through a real tier, loaded into vLLM's processes via
$KV_COMPOSER_PLUGIN_MODULES.

``faulty-tier`` is a real ``offload-cpu`` node (it moves real KV bytes) that
raises in one chosen hook, on the ``fault_call``-th call of that hook while it
is *active*. A node is active for the requests numbered ``[active_from,
active_to)`` in arrival order (its scheduler half counts them; the worker half
learns it from the metadata), so one engine can run one fault per node, one node
after another, each over its own prompts. Outside its window the node neither
looks up, saves nor loads anything. Each injected fault is appended to
``fired``, a JSON-lines file.

``block-watch`` (scheduler) records vLLM's free KV block count at every new
request, so a test sees blocks still held after their requests finished.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.registration import capabilities
from kvc_offload_cpu.scheduler import SchedulerHalf
from kvc_offload_cpu.worker import WorkerHalf
from pydantic import BaseModel, ConfigDict

from composer import Capabilities, PluginType, hookimpl
from composer.plugin import NodeContext, Plugin


class FaultyTierConfig(OffloadCPUConfig):
    fault_hook: str
    fault_call: int = 1
    active_from: int = 0
    active_to: int = 1 << 30
    fired: str


@dataclass
class Wrapped:
    """The tier's own metadata, plus whether this step falls in the node's window."""

    inner: Any
    active: bool


class InjectedFault(RuntimeError):
    pass


class _Faulty:
    """The fault, shared by both halves: raise in ``fault_hook`` on its ``fault_call``-th
    call."""

    config: FaultyTierConfig
    node_id: str
    ctx: NodeContext
    calls = 0

    def _check(self, hook: str) -> None:
        if hook != self.config.fault_hook:
            return
        self.calls += 1
        if self.calls != self.config.fault_call:
            return
        with open(self.config.fired, "a") as f:
            fired = {"node": self.node_id, "hook": hook, "pid": os.getpid()}
            f.write(json.dumps({**fired, "role": self.ctx.process}) + "\n")
        raise InjectedFault(f"injected fault in {hook} (call {self.calls})")


class FaultyScheduler(_Faulty, SchedulerHalf):
    config: FaultyTierConfig

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.index_of: dict[str, int] = {}
        self.live: set[str] = set()  # active requests not finished yet
        self.seen_active = False

    def _mine(self, request: Any) -> bool:
        rid = request.request_id
        if rid not in self.index_of:
            self.index_of[rid] = len(self.index_of)
        return self.config.active_from <= self.index_of[rid] < self.config.active_to

    def _phase(self) -> bool:
        """Inside the window (from the first active request until the last one has
        finished)."""
        return bool(self.live) or (self.seen_active and not self._window_over())

    def _window_over(self) -> bool:
        return len(self.index_of) >= self.config.active_to

    @hookimpl
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._check("bind_kv_cache_manager")

    @hookimpl
    def shutdown(self) -> None:
        self._check("shutdown")

    @hookimpl
    def on_new_request(self, request: Any) -> None:
        if not self._mine(request):
            return
        self.live.add(request.request_id)
        self.seen_active = True
        self._check("on_new_request")
        super().on_new_request(request)

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._mine(request):
            return 0, False
        self._check("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        if not self._mine(request):
            return
        self._check("update_state_after_alloc")
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    @hookimpl
    def build_connector_meta(self, step: Any) -> Wrapped:
        active = self._phase()
        if active:
            self._check("build_connector_meta")
        return Wrapped(super().build_connector_meta(step), active)

    @hookimpl
    def update_connector_output(self, worker_meta: Any) -> None:
        if self._phase():
            self._check("update_connector_output")
        super().update_connector_output(worker_meta)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        if not self._mine(request):
            return False, None
        self.live.discard(request.request_id)
        self._check("request_finished")
        return super().request_finished(request, block_ids)

    @hookimpl
    def take_events(self) -> list[Any]:
        if self._phase():
            self._check("take_events")
        return []

    @hookimpl
    def has_pending_block_frees(self) -> bool:
        if self._phase():
            self._check("has_pending_block_frees")
        return False

    @hookimpl
    def get_kv_connector_stats(self) -> None:
        if self._phase():
            self._check("get_kv_connector_stats")


class FaultyWorker(_Faulty, WorkerHalf):
    """Active while the scheduler's metadata of this step says so."""

    config: FaultyTierConfig

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.active = False

    def _step(self, hook: str) -> None:
        if self.active:
            self._check(hook)

    @hookimpl
    def register_kv_caches(self, kv_caches: Any) -> None:
        self._check("register_kv_caches")
        super().register_kv_caches(kv_caches)

    @hookimpl
    def shutdown(self) -> None:
        self._check("shutdown")
        super().shutdown()

    @hookimpl
    def handle_preemptions(self, metadata: Any) -> None:
        self.active = bool(metadata is not None and metadata.active)
        self._step("handle_preemptions")
        super().handle_preemptions(metadata.inner if metadata is not None else None)

    @hookimpl
    def bind_connector_metadata(self, metadata: Any) -> None:
        self.active = bool(metadata is not None and metadata.active)
        self._step("bind_connector_metadata")
        super().bind_connector_metadata(metadata.inner if metadata is not None else None)

    @hookimpl
    def start_load_kv(self) -> None:
        self._step("start_load_kv")
        super().start_load_kv()

    @hookimpl
    def wait_for_layer_load(self, layer_name: str) -> None:
        self._step("wait_for_layer_load")

    @hookimpl
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        self._step("save_kv_layer")

    @hookimpl
    def wait_for_save(self) -> None:
        self._step("wait_for_save")
        super().wait_for_save()

    @hookimpl
    def clear_connector_metadata(self) -> None:
        self._step("clear_connector_metadata")
        super().clear_connector_metadata()

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._step("get_finished")
        return super().get_finished(finished_req_ids)

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        self._step("get_block_ids_with_load_errors")
        return super().get_block_ids_with_load_errors()

    @hookimpl
    def build_connector_worker_meta(self) -> Any:
        self._step("build_connector_worker_meta")
        return super().build_connector_worker_meta()

    @hookimpl
    def get_kv_connector_stats(self) -> None:
        self._step("get_kv_connector_stats")

    @hookimpl
    def get_kv_connector_kv_cache_events(self) -> None:
        self._step("get_kv_connector_kv_cache_events")


class BlockWatchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


class BlockWatch(Plugin[BlockWatchConfig]):
    """Appends ``[request index, free blocks]`` at every new request."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.pool: Any = None
        self.n = 0

    @hookimpl
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.pool = kv_cache_manager.block_pool

    @hookimpl
    def on_new_request(self, request: Any) -> None:
        with open(self.config.path, "a") as f:
            f.write(json.dumps([self.n, self.pool.get_num_free_blocks()]) + "\n")
        self.n += 1


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="faulty-tier",
            scheduler=FaultyScheduler,
            worker=FaultyWorker,
            config=FaultyTierConfig,
            capabilities=capabilities,  # offload-cpu's: HMA, so hybrid models keep it
        )
    )
    register(
        PluginType(
            name="block-watch",
            scheduler=BlockWatch,
            config=BlockWatchConfig,
            roles={"service"},
            capabilities=Capabilities(hma=True),
        )
    )
