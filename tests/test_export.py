"""``kv_transfer_config``: plain MultiConnector JSON only when MultiConnector means the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from composer import ResolvedPipeline, kv_transfer_config, load_pipeline
from composer.discovery import Registry
from composer.export import MULTICONNECTOR_SAFE, MULTICONNECTOR_SAFE_NODE
from composer.pipeline import Node, Pipeline

Valid = Callable[..., ResolvedPipeline]

TWO_NATIVE = """\
version: 1
kv_role: kv_producer
nodes:
  nixl:
    plugin: vllm
    config:
      connector: NixlConnector
      kv_role: kv_both
      engine_id: engine-0
      kv_buffer_device: cpu
      kv_port: 5600
  mine:
    plugin: vllm
    config:
      connector: MyConnector
      module_path: my_pkg.connectors
      extra_config: {path: /data/kv, depth: 2}
"""


def test_native_nodes_export_as_multiconnector_children_in_order(valid: Valid) -> None:
    assert kv_transfer_config(valid(TWO_NATIVE)) == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "NixlConnector",
                    "kv_role": "kv_both",
                    "engine_id": "engine-0",
                    "kv_buffer_device": "cpu",
                    "kv_port": 5600,
                },
                {
                    "kv_connector": "MyConnector",
                    # A child without its own kv_role takes the pipeline's.
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"path": "/data/kv", "depth": 2},
                    "kv_connector_module_path": "my_pkg.connectors",
                },
            ]
        },
    }


@pytest.mark.parametrize(
    "change",
    [
        "load_policy: longest_hit\n",
        "load_order: [mine, nixl]\n",
        "save_to: [nixl]\n",
        "hma: off\n",
        "annotate_outputs: true\n",
        "time_layer_hooks: true\n",
        "time_step_hooks: true\n",
        "trace: true\n",
    ],
)
def test_anything_multiconnector_cannot_express_needs_the_composed_connector(
    valid: Valid, change: str
) -> None:
    config = kv_transfer_config(valid(TWO_NATIVE + change))
    assert config["kv_connector"] == "ComposedConnector"
    assert "kv_load_failure_policy" not in config


def test_a_setting_vllms_config_cannot_say_needs_the_composed_connector(valid: Valid) -> None:
    text = TWO_NATIVE.replace("kv_port: 5600\n", "kv_port: 5600\n      nixl_poll_ms: 1\n")
    config = kv_transfer_config(valid(text))
    assert config["kv_connector"] == "ComposedConnector"


def test_every_pipeline_and_node_setting_is_classified_for_multiconnector() -> None:
    # A new setting must say whether MultiConnector JSON keeps it, or it could be
    # silently dropped by `kvc export`.
    assert set(MULTICONNECTOR_SAFE) == set(Pipeline.model_fields)
    assert set(MULTICONNECTOR_SAFE_NODE) == set(Node.model_fields)


def test_error_policy_other_than_fail_asks_vllm_to_recompute(valid: Valid) -> None:
    text = TWO_NATIVE.replace("  mine:\n", "  mine:\n    on_error: disable\n")
    config = kv_transfer_config(valid(text))
    assert config["kv_connector"] == "ComposedConnector"
    assert config["kv_load_failure_policy"] == "recompute"


def test_a_needs_edge_or_a_plugin_node_needs_the_composed_connector(valid: Valid) -> None:
    needs = TWO_NATIVE.replace("  mine:\n", "  mine:\n    needs: [nixl]\n")
    assert kv_transfer_config(valid(needs))["kv_connector"] == "ComposedConnector"
    plugin = TWO_NATIVE + "  c:\n    plugin: cache\n    config: {capacity: 1GiB}\n"
    assert kv_transfer_config(valid(plugin))["kv_connector"] == "ComposedConnector"


def test_inlined_pipeline_revalidates_to_the_same_chain(valid: Valid, registry: Registry) -> None:
    original = valid(
        """\
        version: 1
        load_policy: longest_hit
        nodes:
          t: {plugin: tracker}
          b: {plugin: blend, needs: [t], on_error: recompute}
          c:
            plugin: cache
            config: {capacity: "${CAP:-2GiB}", eviction: fifo}
          off: {plugin: tracker, enabled: false}
        save_to: [c]
        """
    )
    config = kv_transfer_config(original)
    assert config["kv_connector"] == "ComposedConnector"
    inlined: dict[str, Any] = config["kv_connector_extra_config"]["pipeline"]
    # Variables are expanded once, here, not again in every vLLM process.
    assert inlined["nodes"]["c"]["config"]["capacity"] == "2GiB"
    again = load_pipeline(inlined, registry=registry)

    def shape(p: ResolvedPipeline) -> Any:
        return (
            [(n.id, n.plugin.name, n.config, n.role, n.on_error, n.needs) for n in p.nodes],
            p.load_order,
            p.save_to,
            p.load_policy,
            p.kv_role,
            p.hma,
        )

    assert shape(again) == shape(original)


def test_reference_passes_the_path(valid: Valid, tmp_path: Path) -> None:
    pipeline = valid(TWO_NATIVE + "load_policy: longest_hit\n")
    config = kv_transfer_config(pipeline, reference=tmp_path)
    assert config == {
        "kv_connector": "ComposedConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"pipeline": str(tmp_path), "kv_role": "kv_producer"},
    }
