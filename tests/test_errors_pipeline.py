"""Errors of the pipeline-wide stage, the capabilities of all nodes together:
the P/D handshake, the memory pool, KV layouts, the hybrid memory allocator,
kv_transfer_params keys and the model provider; then how problems of every
stage are reported: all at once, in file order, with the file name given.

Test plugin types (``cache``, ``tracker``, ``blend``) and the ``problems``/``valid``
checkers come from conftest; the builtin ``vllm`` type's ``capabilities`` field
declares the rest.
"""

from __future__ import annotations

import pytest
from pipeline_checks import Check, Valid

from composer import PipelineInvalid, validate_text

# --------------------------------------------------------------------------- #
# capabilities across nodes
# --------------------------------------------------------------------------- #


def test_two_handshake_providers(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          nixl: {plugin: vllm, config: {connector: NixlConnector}}
          mooncake: {plugin: vllm, config: {connector: MooncakeConnector}}
        """
    ) == [
        'p.yaml:4:13: nodes.mooncake: both "nixl" and "mooncake" provide the P/D handshake; '
        "at most one node may"
    ]


def test_two_memory_pools(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: vllm, config: {connector: A, capabilities: {provides_memory_pool: true}}}
          b: {plugin: vllm, config: {connector: B, capabilities: {provides_memory_pool: true}}}
        """
    ) == [
        'p.yaml:4:6: nodes.b: both "a" and "b" provide the KV cache memory pool; '
        "at most one node may"
    ]


def test_disagreeing_kv_layouts(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: vllm, config: {connector: A, capabilities: {kv_layout: NHD}}}
          b: {plugin: vllm, config: {connector: B}}
          c: {plugin: vllm, config: {connector: C, capabilities: {kv_layout: HND}}}
        """
    ) == ['p.yaml:5:6: nodes.c: needs KV cache layout HND but "a" needs NHD; all nodes must agree']


def test_hma_on_with_a_node_lacking_hma(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        hma: on
        nodes:
          nixl: {plugin: vllm, config: {connector: NixlConnector}}
          disk: {plugin: vllm, config: {connector: ExampleConnector}}
        """
    ) == [
        'p.yaml:5:9: nodes.disk: does not support the hybrid memory allocator, but "hma: on" '
        "requires every node to (set hma: off or auto, or remove the node)"
    ]


def test_hma_auto_turns_off_when_a_node_lacks_it(valid: Valid) -> None:
    both = "version: 1\nnodes:\n  a: {plugin: vllm, config: {connector: NixlConnector}}\n"
    assert valid(both).hma is True
    mixed = both + "  b: {plugin: vllm, config: {connector: ExampleConnector}}\n"
    assert valid(mixed).hma is False


def test_two_nodes_writing_the_same_transfer_params_key(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          nixl: {plugin: vllm, config: {connector: NixlConnector}}
          mine:
            plugin: vllm
            config:
              connector: Mine
              capabilities: {transfer_params_keys: [remote_host, my_key]}
        """
    ) == [
        'p.yaml:5:5: nodes.mine: writes kv_transfer_params key "remote_host", '
        'which "nixl" writes too'
    ]


def test_node_needing_a_model_without_a_provider(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          tracker: {plugin: tracker}
          blend: {plugin: blend}
        """
    ) == [
        "p.yaml:4:10: nodes.blend.needs: needs the model but no dependency provides it "
        "(add needs: [tracker])"
    ]


def test_model_provider_satisfies_the_need(valid: Valid) -> None:
    pipeline = valid(
        """\
        version: 1
        nodes:
          blend: {plugin: blend, needs: [tracker]}
          tracker: {plugin: tracker}
        """
    )
    # Dependencies first, whatever the file order.
    assert [n.id for n in pipeline.nodes] == ["tracker", "blend"]
    assert pipeline.load_order == ("blend",)


# --------------------------------------------------------------------------- #
# all at once, in file order
# --------------------------------------------------------------------------- #


def test_every_problem_is_reported_at_once_in_file_order(problems: Check) -> None:
    found = problems(
        """\
        version: 1
        nodes:
          a: {plugin: cahce}
          b: {plugin: cache, config: {capacity: 1GiB, colour: red}}
        load_order: [x]
        """
    )
    assert [line.split(": ", 2)[:2] for line in found] == [
        ["p.yaml:3:15", "nodes.a.plugin"],
        ["p.yaml:4:47", "nodes.b.config.colour"],
        ["p.yaml:5:14", "load_order[0]"],
    ]


def test_problems_carry_the_file_name_given(registry: object) -> None:
    with pytest.raises(PipelineInvalid) as info:
        validate_text("version: 1\nnodes: {}\n", file="conf/pipeline.yaml")
    assert str(info.value) == "conf/pipeline.yaml:2:8: nodes: a pipeline needs at least one node"
    assert info.value.problems[0].as_dict() == {
        "file": "conf/pipeline.yaml",
        "line": 2,
        "column": 8,
        "path": "nodes",
        "message": "a pipeline needs at least one node",
    }
