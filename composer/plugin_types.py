"""Plugin types: what a package registers through the discovery hook."""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict

#: The vLLM processes a node can run in.
VllmRole = Literal["scheduler", "worker"]
#: What a node does for the pipeline.
NodeRole = Literal["load", "save", "both", "transport", "service"]
KVLayout = Literal["NHD", "HND"]


class EmptyConfig(BaseModel):
    """Config of a plugin that takes no options."""

    model_config = ConfigDict(extra="forbid")


class Capabilities(BaseModel):
    """What a plugin type can do; the graph checks combine these across nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hma: bool = False
    """Supports vLLM's hybrid memory allocator (``request_finished_all_groups``)."""
    kv_cache_groups: Literal["all", "attention", "one"] = "all"
    """Which KV cache groups it handles; "one" needs ``kv_cache_group`` in its config."""
    needs_model: bool = False
    """Wants the loaded model through ``initialize_worker_connector``."""
    provides_model: bool = False
    """Offers the model to nodes that ``need`` it (the model tracker)."""
    provides_handshake: bool = False
    provides_memory_pool: bool = False
    kv_layout: KVLayout | None = None
    async_save: bool = False
    async_load: bool = False
    requires_piecewise_cudagraph: bool = False
    transfer_params_keys: frozenset[str] = frozenset()
    """``kv_transfer_params`` keys this node writes; two nodes may not share one."""


@dataclass(frozen=True)
class PluginType:
    """One kind of pipeline node, as registered by ``register_plugin_types``.

    ``node`` is the instance class, or ``"module:Class"`` so that validating a
    pipeline never imports the (possibly torch-heavy) runtime module.
    """

    name: str
    node: str | type
    config: type[BaseModel] = EmptyConfig
    description: str = ""
    vllm_roles: frozenset[VllmRole] = frozenset({"scheduler", "worker"})
    default_role: NodeRole = "both"
    #: Roles a node of this type may take in a pipeline.
    roles: frozenset[NodeRole] = frozenset({"load", "save", "both"})
    capabilities: Capabilities = field(default_factory=Capabilities)
    #: Capabilities that depend on the node's config (e.g. which native connector).
    capabilities_for: Callable[[BaseModel], Capabilities] | None = None
    #: Extra checks of a node against the whole pipeline file: yields (path, message).
    check: (
        Callable[[str, BaseModel, dict[str, Any]], Iterable[tuple[tuple[str | int, ...], str]]]
        | None
    ) = None
    #: ``"module:Class"`` of its model for ``kvc simulate`` (see
    #: :class:`composer.simulate.TierModel`); imported only by that command. None: not
    #: modelled, the simulator shows the node as such.
    simulator: str | None = None
    #: Filled by discovery: the distribution that registered it.
    package: str = ""
    version: str = ""

    def node_class(self) -> type:
        if isinstance(self.node, type):
            return self.node
        module, _, attr = self.node.partition(":")
        cls: type = getattr(importlib.import_module(module), attr)
        return cls

    def resolve_capabilities(self, config: BaseModel) -> Capabilities:
        if self.capabilities_for is not None:
            return self.capabilities_for(config)
        return self.capabilities

    def config_fields(self) -> dict[str, Any]:
        return {
            name: {
                "type": _type_name(f.annotation),
                "default": None if f.is_required() else f.get_default(call_default_factory=True),
                "required": f.is_required(),
                "description": f.description or "",
            }
            for name, f in self.config.model_fields.items()
        }


def _type_name(annotation: Any) -> str:
    """A short readable type: ``'kv_producer' | 'kv_both' | None`` rather than ``Optional``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")
