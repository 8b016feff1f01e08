"""The ``kv_transfer_config`` to hand to vLLM for a pipeline."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from composer.builtin import VllmConnectorConfig
from composer.pipeline import ResolvedNode, ResolvedPipeline

CONNECTOR_NAME = "ComposedConnector"


def kv_transfer_config(
    pipeline: ResolvedPipeline, *, reference: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` dict for this pipeline.

    Plain ``MultiConnector`` JSON when every node is a vLLM connector and the
    pipeline asks for nothing MultiConnector cannot do; otherwise the composed
    connector, with the pipeline inlined (or referenced by path).
    """
    if as_multiconnector(pipeline):
        return _multiconnector(pipeline)
    extra: dict[str, Any] = {"pipeline": os.fspath(reference) if reference else pipeline.source}
    if reference:
        # The file may serve either side of P/D: the side this engine plays travels
        # with it (an inline pipeline carries it as its own kv_role).
        extra["kv_role"] = pipeline.kv_role
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": pipeline.kv_role,
        "kv_connector_extra_config": extra,
    }
    if any(n.on_error != "fail" for n in pipeline.nodes):
        # Let vLLM recompute blocks that a node reports as load errors.
        config["kv_load_failure_policy"] = "recompute"
    return config


def _node_ids(pipeline: ResolvedPipeline) -> tuple[str, ...]:
    return tuple(n.id for n in pipeline.nodes)


#: Every pipeline setting (a field of :class:`composer.pipeline.Pipeline`), with
#: the test a pipeline must pass for plain MultiConnector JSON to keep it: vLLM's
#: MultiConnector has no such setting, so only its own behaviour survives.
#: ``tests/test_export.py`` checks this lists every field, so a new setting is
#: classified here before it can be silently dropped.
MULTICONNECTOR_SAFE: dict[str, Callable[[ResolvedPipeline], bool]] = {
    "version": lambda p: True,
    "kv_role": lambda p: True,  # MultiConnector JSON has kv_role
    "nodes": lambda p: all(_node_is_safe(n) for n in p.nodes),
    "load_order": lambda p: p.load_order == _node_ids(p),  # config order, as MultiConnector
    "load_policy": lambda p: p.load_policy == "first_hit",  # MultiConnector's rule
    "save_to": lambda p: p.save_to == _node_ids(p),  # MultiConnector saves to every child
    "hma": lambda p: p.source.get("hma", "auto") == "auto",  # vLLM decides, as for Multi
    "annotate_outputs": lambda p: not p.annotate_outputs,
    "time_layer_hooks": lambda p: not p.time_layer_hooks,
    "time_step_hooks": lambda p: not p.time_step_hooks,
    "trace": lambda p: not p.trace,
}
#: The same for every field of a node (:class:`composer.pipeline.Node`).
MULTICONNECTOR_SAFE_NODE: dict[str, Callable[[ResolvedNode], bool]] = {
    "plugin": lambda n: n.plugin.name == "vllm",
    # Becomes the child's KVTransferConfig, but for what vLLM's config cannot say.
    "config": lambda n: getattr(n.config, "nixl_poll_ms", None) is None,
    "needs": lambda n: not n.needs,
    "role": lambda n: True,  # what it changes shows in load_order / save_to
    "on_error": lambda n: n.on_error == "fail",  # MultiConnector's only behaviour
    "enabled": lambda n: True,  # disabled nodes are not in the resolved pipeline
    # Nor are nodes of the other P/D side: the children left are this side's.
    "sides": lambda n: True,
    "description": lambda n: True,
}


def _node_is_safe(node: ResolvedNode) -> bool:
    return all(check(node) for check in MULTICONNECTOR_SAFE_NODE.values())


def as_multiconnector(pipeline: ResolvedPipeline) -> bool:
    """Whether plain MultiConnector JSON keeps every setting of this pipeline."""
    return all(check(pipeline) for check in MULTICONNECTOR_SAFE.values())


def native_child_config(config: VllmConnectorConfig, default_role: str) -> dict[str, Any]:
    """One ``KVTransferConfig`` dict for a native node, as MultiConnector lists them."""
    child: dict[str, Any] = {
        "kv_connector": config.connector,
        "kv_role": config.kv_role or default_role,
    }
    if config.extra_config:
        child["kv_connector_extra_config"] = config.extra_config
    for key, value in (
        ("kv_connector_module_path", config.module_path),
        ("engine_id", config.engine_id),
        ("kv_buffer_device", config.kv_buffer_device),
        ("kv_port", config.kv_port),
    ):
        if value is not None:
            child[key] = value
    return child


def _multiconnector(pipeline: ResolvedPipeline) -> dict[str, Any]:
    connectors = []
    for node in pipeline.nodes:
        assert isinstance(node.config, VllmConnectorConfig)
        connectors.append(native_child_config(node.config, pipeline.kv_role))
    return {
        "kv_connector": "MultiConnector",
        "kv_role": pipeline.kv_role,
        "kv_connector_extra_config": {"connectors": connectors},
    }
