"""The ``kv_transfer_config`` to hand to vLLM for a pipeline."""

from __future__ import annotations

import os
from typing import Any

from composer.builtin import VllmConnectorConfig
from composer.pipeline import ResolvedPipeline

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
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": pipeline.kv_role,
        "kv_connector_extra_config": extra,
    }
    if any(n.on_error != "fail" for n in pipeline.nodes):
        # Let vLLM recompute blocks that a node reports as load errors.
        config["kv_load_failure_policy"] = "recompute"
    return config


def as_multiconnector(pipeline: ResolvedPipeline) -> bool:
    return (
        pipeline.all_native
        and pipeline.load_policy == "first_hit"
        and not pipeline.annotate_outputs
        and not pipeline.time_layer_hooks
        and all(n.on_error == "fail" and not n.needs for n in pipeline.nodes)
        and pipeline.load_order == tuple(n.id for n in pipeline.nodes)
        and pipeline.save_to == tuple(n.id for n in pipeline.nodes)
    )


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
