"""A node that never touches a KV block (role ``service``: a request counter, the
model tracker) changes nothing of how vLLM runs a hybrid model, and what is wrong
with a node is said at once, its role among the rest."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from composer import ResolvedPipeline
from composer.model.kv_groups import ModelKV, predict
from composer.validation.model_check import check_model

Check = Callable[..., list[str]]
Valid = Callable[..., ResolvedPipeline]

TIER_WITH_HMA = """\
version: 1
{hma}nodes:
  nixl:
    plugin: vllm
    config: {{connector: NixlConnector}}
  counter:
    plugin: tracker
    role: {role}
"""


@pytest.mark.parametrize("hma", ["", "hma: auto\n", "hma: on\n"])
def test_a_service_node_leaves_the_hybrid_manager_on(valid: Valid, hma: str) -> None:
    pipeline = valid(TIER_WITH_HMA.format(hma=hma, role="service"))
    assert pipeline.hma is True
    assert pipeline.node("counter").allows_hma and not pipeline.node("counter").capabilities.hma


def test_a_node_that_touches_blocks_without_hma_still_turns_it_off(valid: Valid) -> None:
    pipeline = valid(
        "version: 1\nnodes:\n  nixl: {plugin: vllm, config: {connector: NixlConnector}}\n"
        "  disk: {plugin: cache, config: {capacity: 1GiB}}\n"
    )
    assert pipeline.hma is False and not pipeline.node("disk").allows_hma


@pytest.fixture
def hybrid(tmp_path: Path) -> ModelKV:
    """A Gemma-3-shaped model: a sliding-window group and a full-attention group."""
    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "dtype": "bfloat16", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 128,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = predict(tmp_path, block_size=32)
    assert len(model.groups) == 2
    return model


def test_a_service_node_serves_a_hybrid_model_as_touching_no_block(
    valid: Valid, hybrid: ModelKV
) -> None:
    check = check_model(valid(TIER_WITH_HMA.format(hma="", role="service")), hybrid)
    assert check.problems == () and check.hma_off == ""
    assert check.serves["counter"] == "touches no KV blocks"
    assert check.runs is check.model  # every group, as predicted


def test_a_role_error_is_reported_with_the_nodes_config_errors(problems: Check) -> None:
    found = problems(
        """\
        version: 1
        nodes:
          counter:
            plugin: tracker
            role: load
            config: {nope: 1}
        """
    )
    role = 'nodes.counter.role: plugin "tracker" cannot take role "load"'
    assert any(role in p for p in found), found
    assert any("nodes.counter.config" in p for p in found), found


def test_vllm_keeps_its_hybrid_manager_beside_a_service_node() -> None:
    """Real vLLM decides (``KVConnectorFactory.supports_hma_config``, which KV Composer
    routes to the pipeline): a tracker node beside an HMA connector leaves it on."""
    from composer.testing.multiconnector import make_vllm_config
    from composer.vllm.registration import register

    register()

    def hybrid_manager_off(nodes: dict[str, object]) -> bool:
        config = make_vllm_config(pipeline={"version": 1, "nodes": nodes})
        return bool(config.scheduler_config.disable_hybrid_kv_cache_manager)

    nixl = {"plugin": "vllm", "config": {"connector": "NixlConnector"}}
    assert hybrid_manager_off({"nixl": nixl}) is False
    assert hybrid_manager_off({"nixl": nixl, "tracker": {"plugin": "model-tracker"}}) is False
    example = {"plugin": "vllm", "config": {"connector": "ExampleConnector"}}
    assert hybrid_manager_off({"nixl": nixl, "example": example}) is True
