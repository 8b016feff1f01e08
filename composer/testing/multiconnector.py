"""MultiConnector configurations as KV Composer pipelines, for parity tests.

A MultiConnector lists child ``KVTransferConfig`` dicts; the same children as
``vllm`` nodes, in the same order, make a pipeline with MultiConnector's
semantics (the first node with a hit loads, every node saves). Used by the
tests that hold ComposedConnector to MultiConnector's behaviour, vLLM's own
test file among them.
"""

from __future__ import annotations

from typing import Any

from composer.export import CONNECTOR_NAME
from composer.testing.tiny_model import build_tiny_model

#: KVTransferConfig keys of a child and the ``vllm`` node option each becomes.
_CHILD_KEYS = {
    "kv_connector": "connector",
    "kv_role": "kv_role",
    "kv_connector_module_path": "module_path",
    "engine_id": "engine_id",
    "kv_buffer_device": "kv_buffer_device",
    "kv_port": "kv_port",
    "kv_connector_extra_config": "extra_config",
}


def node_ids(children: list[dict[str, Any]]) -> list[str]:
    """Node ids for MultiConnector's children: the connector name, numbered when repeated."""
    names = [c["kv_connector"] for c in children]
    ids = []
    for i, name in enumerate(names):
        ids.append(name if names.count(name) == 1 else f"{name}_{names[:i].count(name)}")
    return ids


def pipeline_for(
    children: list[dict[str, Any]], kv_role: str = "kv_both", hma: str = "auto"
) -> dict[str, Any]:
    """The pipeline (as ``kvc export`` inlines it) running ``children`` as MultiConnector does."""
    nodes: dict[str, Any] = {}
    for node_id, child in zip(node_ids(children), children, strict=True):
        unknown = set(child) - set(_CHILD_KEYS)
        if unknown:
            raise ValueError(f"child options with no vllm node equivalent: {sorted(unknown)}")
        config = {_CHILD_KEYS[k]: v for k, v in child.items() if v is not None}
        nodes[node_id] = {"plugin": "vllm", "config": config}
    return {"version": 1, "kv_role": kv_role, "hma": hma, "nodes": nodes}


def composed_transfer_config(kv_transfer_config: Any, hma: str = "auto") -> Any:
    """The ComposedConnector ``KVTransferConfig`` of a MultiConnector one."""
    from vllm.config.kv_transfer import KVTransferConfig

    children = kv_transfer_config.kv_connector_extra_config["connectors"]
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role=kv_transfer_config.kv_role,
        engine_id=kv_transfer_config.engine_id,
        kv_connector_extra_config={
            "pipeline": pipeline_for(children, kv_transfer_config.kv_role, hma)
        },
    )


def make_vllm_config(
    children: list[dict[str, Any]] | None = None,
    *,
    kv_role: str = "kv_both",
    hma: str = "auto",
    disable_hybrid_kv_cache_manager: bool | None = None,
    pipeline: dict[str, Any] | None = None,
) -> Any:
    """A CPU ``VllmConfig`` of the tiny local model whose connector runs ``children``
    as a pipeline, or ``pipeline`` as it is (vLLM's own choices made, the hybrid KV
    cache manager's among them).

    KV Composer's vLLM plugin must be registered (``composer.vllm.registration``).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )


    kv_transfer_config = None
    if children is not None:
        pipeline = pipeline_for(children, kv_role, hma)
    if pipeline is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config={"pipeline": pipeline},
        )
    return VllmConfig(
        model_config=ModelConfig(model=str(build_tiny_model()), dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=64,
            max_model_len=256,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        ),
        cache_config=CacheConfig(block_size=16),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
