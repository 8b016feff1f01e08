"""The pipeline a ``ComposedConnector`` runs, read from vLLM's ``kv_connector_extra_config``.

Also where a native node's vLLM config is built (``child_vllm_config`` in
:mod:`composer.vllm.native` builds the node's own; this module finds the
connector classes before any instance exists, for vLLM's class-level questions).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from composer.builtin import VllmConnectorConfig
from composer.export import native_child_config
from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.validation import load_pipeline
from composer.validation.deep_check import cannot_sleep, deep_check
from composer.validation.model_check import check_at_engine_start
from composer.vllm.native import child_vllm_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class _Named:
    """The pipeline ``kv_connector_extra_config`` names, hashed and compared (a cache
    key) by ``key``: its ``pipeline`` (a path, or the pipeline inline) and ``kv_role``."""

    spec: Any = field(compare=False)
    kv_role: str | None = field(compare=False)
    key: Hashable


def _named(extra: dict[str, Any]) -> _Named:
    spec = extra.get("pipeline")
    if spec is None:
        raise ValueError(
            'ComposedConnector needs kv_connector_extra_config["pipeline"]: '
            "a pipeline file path or the pipeline inline (see `kvc export`)"
        )
    # The P/D side a referenced file runs as (see composer.export) is part of the key.
    kv_role = extra.get("kv_role")
    return _Named(spec, kv_role, _frozen((spec, kv_role)))


def _frozen(value: Any) -> Hashable:
    """Config data as a key: mappings and lists in their order (node order is the
    default load order), each value with its type (``1``, ``1.0``, ``true`` differ)."""
    if isinstance(value, Mapping):
        return (dict, tuple((_frozen(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (list, tuple(_frozen(v) for v in value))
    return (type(value), value)


@lru_cache(maxsize=16)
def _validated(named: _Named) -> ResolvedPipeline:
    # A copy: the cached pipeline keeps none of vLLM's config objects.
    return load_pipeline(copy.deepcopy(named.spec), kv_role=named.kv_role)


def validated_pipeline(extra: dict[str, Any]) -> ResolvedPipeline:
    """The pipeline named by ``kv_connector_extra_config["pipeline"]`` (path or inline),
    validated; cached, as vLLM asks its class-level questions more than once."""
    return _validated(_named(extra))


def hma_resolved_pipeline(extra: dict[str, Any]) -> ResolvedPipeline:
    """:func:`validated_pipeline` with native nodes' HMA support from their connector
    classes, and the pipeline's ``hma`` decided from its nodes'."""
    return _resolve_hma(_named(extra))


@lru_cache(maxsize=16)
def _resolve_hma(named: _Named) -> ResolvedPipeline:
    pipeline = _validated(named)
    nodes = []
    for node in pipeline.nodes:
        if node.plugin.name == "vllm":
            # Validation only has a table of vLLM's connectors (it must not import
            # vLLM); what vLLM itself goes by is the class: SupportsHMA or not.
            hma = KVConnectorFactory.supports_hma_config(native_transfer_config(node, pipeline))
            if hma != node.capabilities.hma:
                caps = node.capabilities.model_copy(update={"hma": hma})
                node = dataclasses.replace(node, capabilities=caps)
        nodes.append(node)
    mode = pipeline.source.get("hma", "auto")
    hma = mode != "off" and all(n.allows_hma for n in nodes)
    if mode == "on" and not hma:
        lacking = [n.id for n in nodes if not n.allows_hma]
        raise ValueError(
            f'{pipeline.file}: hma: "hma: on" needs every node to support HMA, but the '
            f"connector classes of nodes {lacking} do not implement vLLM's SupportsHMA"
        )
    return dataclasses.replace(pipeline, nodes=tuple(nodes), hma=hma)


def native_transfer_config(node: ResolvedNode, pipeline: ResolvedPipeline) -> Any:
    """A native node's ``KVTransferConfig``, as MultiConnector builds its children's
    (the one place a child config is built from a pipeline; ``child_vllm_config``
    wraps it in a vLLM config for the node's own connector)."""
    from vllm.config.kv_transfer import KVTransferConfig

    child = native_child_config(cast(VllmConnectorConfig, node.config), pipeline.kv_role)
    return KVTransferConfig(**child)


def native_classes(
    pipeline: ResolvedPipeline, vllm_config: VllmConfig
) -> list[tuple[str, type[KVConnectorBase_V1], Any]]:
    """(node id, connector class, the node's vLLM config) of every native node."""

    out = []
    for node in pipeline.nodes:
        if node.plugin.name == "vllm":
            temp = child_vllm_config(cast(VllmConnectorConfig, node.config), vllm_config)
            connector_cls = KVConnectorFactory.get_connector_class(temp.kv_transfer_config)
            out.append((node.id, cast(type[KVConnectorBase_V1], connector_cls), temp))
    return out


def required_kvcache_layout(pipeline: ResolvedPipeline, vllm_config: VllmConfig) -> str | None:
    """The KV cache layout every node agrees on (plugins' capabilities, native
    connectors' own answers), or None; disagreement is an error."""
    layouts: dict[str, str] = {}
    for node in pipeline.nodes:
        if node.capabilities.kv_layout:
            layouts[node.id] = node.capabilities.kv_layout
    for node_id, connector_cls, temp in native_classes(pipeline, vllm_config):
        layout = connector_cls.get_required_kvcache_layout(temp)
        if layout is not None:
            layouts[node_id] = layout
    if len(set(layouts.values())) > 1:
        raise ValueError(f"KV cache layout mismatch between nodes: {layouts}; all must agree")
    return next(iter(layouts.values()), None)


def requires_piecewise(pipeline: ResolvedPipeline) -> bool:
    """Whether any node (or a native node's connector) needs piecewise CUDA graphs."""
    for node in pipeline.nodes:
        if node.capabilities.requires_piecewise_cudagraph:
            return True
        if node.plugin.name == "vllm":
            child = native_transfer_config(node, pipeline)
            connector_cls = KVConnectorFactory.get_connector_class(child)
            if connector_cls.requires_piecewise_for_cudagraph(child.kv_connector_extra_config):
                return True
    return False


def sleep_mode_refusals(pipeline: ResolvedPipeline) -> list[tuple[ResolvedNode, str]]:
    """The nodes that cannot follow vLLM's sleep mode, each with why; the pipeline
    can sleep when there are none (MultiConnector's rule: every child must).

    A ``vllm`` node answers with its connector class's own ``supports_sleep_mode``
    (vLLM releases without it have no sleep-mode gate, nor hooks to tell a
    connector); any other node as :func:`~composer.validation.deep_check.cannot_sleep` says.
    """

    out: list[tuple[ResolvedNode, str]] = []
    for node in pipeline.nodes:
        if node.plugin.name != "vllm":
            why = cannot_sleep(node)
        else:
            child = native_transfer_config(node, pipeline)
            connector_cls = KVConnectorFactory.get_connector_class(child)
            gate = getattr(connector_cls, "supports_sleep_mode", None)
            why = ""
            if gate is not None and not gate(child):
                why = f"{connector_cls.__name__}.supports_sleep_mode says no for this config"
        if why:
            out.append((node, why))
    return out


def pipeline_checked_for_engine(vllm_config: VllmConfig, kv_cache_config: Any) -> ResolvedPipeline:
    """The pipeline a starting engine runs, refused (``ValueError``) with the messages
    ``kvc validate`` gives where it cannot serve this engine's KV cache groups."""
    assert vllm_config.kv_transfer_config is not None
    pipeline = hma_resolved_pipeline(vllm_config.kv_transfer_config.kv_connector_extra_config)
    deep_check_at_start(pipeline)
    # vLLM turns its hybrid manager off unless every node supports HMA
    # (all_nodes_support_hma, as for MultiConnector), or unless the user
    # turned it on explicitly (--no-disable-hybrid-kv-cache-manager): then
    # several KV cache groups could reach nodes that cannot take them.
    groups = len(kv_cache_config.kv_cache_groups)
    hma_on = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    if hma_on and groups > 1 and not pipeline.hma:
        lacking = [n.id for n in pipeline.nodes if not n.allows_hma]
        raise ValueError(
            f"this model has {groups} KV cache groups and vLLM's hybrid KV cache manager "
            f"is on, but nodes {lacking} do not support it: pass "
            "--disable-hybrid-kv-cache-manager, or use nodes with HMA support"
        )
    # What a node cannot serve of these groups stops the engine here, with the
    # message `kvc validate --model` gives, not deep inside the node.
    model_config = vllm_config.model_config  # (None in a bare VllmConfig)
    check_at_engine_start(
        pipeline, kv_cache_config, model_name=model_config.model if model_config else ""
    )
    return pipeline


def deep_check_at_start(pipeline: ResolvedPipeline) -> None:
    """At engine start, native connector names are checked against vLLM's registry
    (the chain checks its node classes itself as it creates the nodes)."""
    problems = deep_check(pipeline, classes=False)
    if problems:
        raise ValueError("invalid pipeline:\n" + "\n".join(str(p) for p in problems))
