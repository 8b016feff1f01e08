"""The runtime half of the built-in ``vllm`` plugin: a vLLM connector as a node.

The connector is created through vLLM's ``KVConnectorFactory`` (not by calling
its class), so the factory's compatibility and HMA checks apply, and every
hook forwards vLLM's raw objects to it unchanged, exactly as MultiConnector does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
from typing import Any, cast
from unittest import mock

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)

from composer.builtin import NIXL_API, VllmConnectorConfig, nixl_poll_problem
from composer.export import native_child_config
from composer.hook_table import HOOKS, Native, hooks_where
from composer.hookspecs import NodeSpec, hookimpl
from composer.plugin import NodeContext, Plugin

#: How each hook reaches the connector is its row's ``native`` and
#: ``skip_if_default`` in :data:`composer.hook_table.HOOKS`.
#: Hooks vLLM's method of the same name takes with the spec's arguments: each is
#: one generated hookimpl below, and a direct call where it is hot.
PASS_THROUGH = hooks_where(native=Native.AS_IS)
#: Per-step hooks whose hookimpl below takes exactly vLLM's arguments (a subset of
#: the spec's): a direct call to the connector's method too.
DIRECT_SUBSET = hooks_where(native=Native.DIRECT)
#: Hooks whose vLLM base-class default does nothing and returns what the chain
#: combines as "nothing"; each with the connector methods it reaches. A node whose
#: connector keeps all of those defaults is left out of the hook's call list.
SKIP_IF_DEFAULT = {name: h.skip_if_default for name, h in HOOKS.items() if h.skip_if_default}


def _is_base_default(connector: Any, name: str) -> bool:
    method = getattr(connector, name, None)
    return getattr(method, "__func__", None) is getattr(KVConnectorBase_V1, name, None)


def child_vllm_config(config: VllmConnectorConfig, vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` whose kv_transfer_config is this node's."""
    parent = vllm_config.kv_transfer_config
    child = native_child_config(config, parent.kv_role)
    # The composed connector's engine id, unless the node names its own.
    child.setdefault("engine_id", parent.engine_id)
    temp = copy.copy(vllm_config)
    temp.kv_transfer_config = KVTransferConfig(**child)
    return temp


def nixl_poll(config: VllmConnectorConfig) -> contextlib.AbstractContextManager[Any]:
    """While it is open, the NIXL agents made get the node's ``nixl_poll_ms`` as their
    progress thread's wait. NIXL's Python API sets that wait to 0 itself and takes no
    setting for it, so the bindings it makes agents with are wrapped for the time the
    connector is created; nothing else changes."""
    poll_ms = config.nixl_poll_ms
    if poll_ms is None:
        return contextlib.nullcontext()
    if why := nixl_poll_problem():
        raise RuntimeError(f"nixl_poll_ms: {why}")
    api = importlib.import_module(NIXL_API)
    return mock.patch.object(api, "nixlBind", PolledBindings(api.nixlBind, poll_ms * 1000))


class PolledBindings:
    """NIXL's bindings, whose agents' progress threads wait ``delay_us`` for events."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self.bindings, self.delay_us = bindings, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bindings, name)

    def nixlAgent(self, name: str, agent_config: Any) -> Any:  # noqa: N802 - NIXL's name
        agent_config.pthrDelay = self.delay_us
        return self.bindings.nixlAgent(name, agent_config)


class NativeConnectorNode(Plugin):
    def __init__(self, ctx: NodeContext, connector: VllmConnectorConfig | None = None) -> None:
        """``connector``: the vLLM connector to wrap, for a plugin whose own config
        is not a ``VllmConnectorConfig`` (it keeps its config; default: the node's)."""
        super().__init__(ctx)
        config = connector or cast(VllmConnectorConfig, ctx.config)
        role = KVConnectorRole.SCHEDULER if ctx.process == "scheduler" else KVConnectorRole.WORKER
        temp = child_vllm_config(config, ctx.vllm_config)
        connector_cls = KVConnectorFactory.get_connector_class(temp.kv_transfer_config)
        groups = len(getattr(ctx.kv_cache_config, "kv_cache_groups", ()) or ())
        if not supports_hma(connector_cls) and groups <= 1:
            # The hybrid manager can be on while this connector lacks HMA (the
            # user turned it on explicitly). With one KV cache group the chain
            # turns request_finished_all_groups into request_finished for this
            # node, so the factory's HMA refusal does not apply. (Several groups
            # without HMA are refused at engine start, by the composed connector.)
            temp.scheduler_config = copy.copy(temp.scheduler_config)
            temp.scheduler_config.disable_hybrid_kv_cache_manager = True
        with nixl_poll(config):
            self.connector = KVConnectorFactory.create_connector(temp, role, ctx.kv_cache_config)
        #: How another process finds this connector's class again (to rebuild
        #: its stats there): vLLM's name, and the module path of an out-of-tree one.
        self.identity: dict[str, str] = {"name": config.connector}
        if config.module_path:
            self.identity["module_path"] = config.module_path

    def direct_hooks(self) -> dict[str, Any]:
        """Pass-through hooks bound straight to the connector's methods: no wrapper on
        the per-layer and per-step paths. A hook mapped to None is not called at
        all: the connector keeps vLLM's do-nothing default for it. A subclass that
        overrides a pass-through hook keeps its override (it is not made direct).
        """
        c = self.connector
        hooks: dict[str, Any] = {}
        for hook in (*PASS_THROUGH, *DIRECT_SUBSET, *SKIP_IF_DEFAULT):
            if getattr(type(self), hook) is not getattr(NativeConnectorNode, hook):
                continue  # a subclass's override
            defaults = SKIP_IF_DEFAULT.get(hook)
            if defaults and all(_is_base_default(c, m) for m in defaults):
                hooks[hook] = None
            elif hook in PASS_THROUGH or hook in DIRECT_SUBSET:
                hooks[hook] = getattr(c, hook)
        return hooks

    # Hooks whose arguments are not vLLM's own: the request view's raw request,
    # a different order, or what vLLM's method does not take.

    @hookimpl
    def register_kv_caches(self, raw: dict[str, Any]) -> None:
        self.connector.register_kv_caches(raw)

    @hookimpl
    def restore_kv_caches(self) -> None:
        # vLLM's connectors take their registrations again from what
        # register_kv_caches gave them (vLLM remaps the same tensors). vLLM 0.33+:
        # on earlier releases the chain calls no connector without the method.
        cast(Any, self.connector).restore_kv_caches()

    @hookimpl
    def on_new_request(self, request: Any) -> None:
        self.connector.on_new_request(request.raw)

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self.connector.get_num_new_matched_tokens(request.raw, num_computed_tokens)

    @hookimpl
    def update_state_after_alloc(self, request: Any, num_external_tokens: int, blocks: Any) -> None:
        self.connector.update_state_after_alloc(request.raw, blocks, num_external_tokens)

    @hookimpl
    def get_loaded_kv_cache_group_ids(self, request: Any) -> Any:
        return self.connector.get_loaded_kv_cache_group_ids(request.raw)

    @hookimpl
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        return self.connector.get_external_cache_hit_sources(request.raw, num_external_tokens)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.connector.build_connector_meta(scheduler_output)

    @hookimpl
    def update_connector_output(self, connector_output: Any) -> None:
        # The chain has put this node's own worker metadata in the output.
        self.connector.update_connector_output(connector_output)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        return self.connector.request_finished(request.raw, block_ids)

    @hookimpl
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        if not supports_hma(self.connector):
            raise TypeError(f"{type(self.connector).__name__} does not support HMA")
        return cast(SupportsHMA, self.connector).request_finished_all_groups(request.raw, block_ids)

    @hookimpl
    def register_finished_partial_tail(
        self, request: Any, block_ids: Any, partial_tail_offloads: Any
    ) -> bool:
        return self.connector.register_finished_partial_tail(
            request.raw, block_ids, partial_tail_offloads
        )


def _pass_through(hook: str) -> Any:
    """A hookimpl calling the connector's ``hook`` with the spec's arguments.

    ``functools.wraps`` makes pluggy read the spec's own argument names (it
    unwraps ``__wrapped__``), so the chain passes every spec argument.
    """

    @functools.wraps(getattr(NodeSpec, hook))
    def forward(self: NativeConnectorNode, *args: Any) -> Any:
        return getattr(self.connector, hook)(*args)

    return hookimpl(forward)


for _hook in PASS_THROUGH:
    setattr(NativeConnectorNode, _hook, _pass_through(_hook))
