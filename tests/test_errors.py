"""Every class of bad pipeline input: exact location, dotted path and message.

Test plugin types (``cache``, ``tracker``, ``blend``) come from conftest; the
builtin ``vllm`` type's ``capabilities`` field declares the rest.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from composer import (
    Capabilities,
    Int,
    Node,
    Number,
    Pipeline,
    PipelineInvalid,
    PluginType,
    PositiveByteSize,
    Registry,
    ResolvedPipeline,
    discover,
    hookimpl,
    load_pipeline,
    validate_text,
)
from composer.discovery import PluginLoadError
from composer.errors import escape

Check = Callable[..., list[str]]
Valid = Callable[..., ResolvedPipeline]


# --------------------------------------------------------------------------- #
# YAML
# --------------------------------------------------------------------------- #


def test_yaml_is_parsed_by_libyaml() -> None:
    # The syntax-error messages below are libyaml's (PyYAML's pure-Python parser words
    # them differently); libyaml is also what keeps validation fast.
    assert yaml.__with_libyaml__


def test_yaml_syntax_error_points_at_the_problem_and_where_the_construct_started(
    problems: Check,
) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: cache, config: {capacity: 8GiB
        """
    ) == [
        "p.yaml:4:1: <root>: YAML syntax error: did not find expected ',' or '}' "
        "(while parsing a flow mapping at line 3, column 30)"
    ]


def test_tab_indentation_says_to_use_spaces(problems: Check) -> None:
    assert problems("version: 1\nnodes:\n\ta: {plugin: cache}\n") == [
        "p.yaml:3:1: <root>: YAML syntax error: found character that cannot start any token "
        "(while scanning for the next token); indent with spaces, YAML does not allow tabs"
    ]


def test_unquoted_variable_inside_a_flow_mapping_gets_a_quoting_hint(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: vllm, config: {connector: X, kv_port: ${PORT:-9}}}
        """,
    ) == [
        "p.yaml:3:54: <root>: YAML syntax error: did not find expected ',' or '}' "
        "(while parsing a flow mapping at line 3, column 29); "
        "quote ${...} values inside {...} and [...]"
    ]


def test_duplicate_key_is_an_error_not_last_one_wins(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a:
            plugin: cache
            config:
              capacity: 1GiB
              capacity: 2GiB
        """
    ) == ['p.yaml:7:7: nodes.a.config.capacity: duplicate key "capacity" (first defined at line 6)']


def test_duplicate_node_id_is_a_duplicate_mapping_key(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: cache, config: {capacity: 1GiB}}
          b: {plugin: cache, config: {capacity: 1GiB}}
          a: {plugin: cache, config: {capacity: 2GiB}}
        """
    ) == ['p.yaml:5:3: nodes.a: duplicate key "a" (first defined at line 3)']


def test_unsupported_tag_is_reported_and_nothing_is_constructed(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: !!python/object/apply:os.system {plugin: cache}
        """
    ) == ["p.yaml:3:6: nodes.a: unsupported YAML tag !!python/object/apply:os.system"]


def test_empty_file_and_non_mapping_documents(problems: Check) -> None:
    assert problems("") == ["p.yaml:1:1: <root>: the pipeline file is empty"]
    assert problems("# only a comment\n") == ["p.yaml:1:1: <root>: the pipeline file is empty"]
    assert problems("- a\n- b\n") == [
        "p.yaml:1:1: <root>: a pipeline is a mapping with version and nodes, not a list"
    ]


# --------------------------------------------------------------------------- #
# environment variables
# --------------------------------------------------------------------------- #


def test_unset_variable_is_reported_once_at_its_value(problems: Check) -> None:
    # Only the variable: the unexpanded text failing ByteSize would repeat the same mistake.
    assert problems(
        """\
        version: 1
        nodes:
          a:
            plugin: cache
            config:
              capacity: ${CPU_CAPACITY}
        """
    ) == [
        "p.yaml:6:17: nodes.a.config.capacity: environment variable ${CPU_CAPACITY} is not set "
        "(give a default with ${CPU_CAPACITY:-value})"
    ]


def test_variables_and_defaults_expand_to_text_that_typed_fields_convert(valid: Valid) -> None:
    pipeline = valid(
        """\
        version: 1
        nodes:
          a:
            plugin: cache
            config:
              capacity: ${CAPACITY:-2GiB}
              min_blocks: ${MIN_BLOCKS}
              checksums: ${CHECKSUMS:-true}
              eviction: "${EVICTION:-fifo}"
          n:
            plugin: vllm
            config:
              connector: ${CONNECTOR}
              kv_port: ${PORT:-5600}
              engine_id: "${PORT:-5600}"
              extra_config: {path: "$${HOME}/kv", empty: "${EMPTY:-fallback}"}
        """,
        env={"MIN_BLOCKS": "16", "CONNECTOR": "ExampleConnector", "EMPTY": ""},
    )
    cache, native = pipeline.node("a").config, pipeline.node("n").config
    assert cache.model_dump() == {
        "capacity": 2 * 1024**3,
        "eviction": "fifo",
        "min_blocks": 16,
        "checksums": True,
    }
    # The file's data as written: the plugin's model converts it again wherever it runs.
    assert pipeline.source["nodes"]["a"]["config"]["min_blocks"] == "16"
    assert native.connector == "ExampleConnector"
    assert native.kv_port == 5600
    # A string field keeps the text even though it looks like a number.
    assert native.engine_id == "5600"
    assert native.extra_config == {"path": "${HOME}/kv", "empty": "fallback"}


class _TypedConfig(BaseModel):
    """A field of each kind plugins use, for values that arrive through ${VAR}."""

    model_config = ConfigDict(extra="forbid")

    size: PositiveByteSize = ByteSize(1)
    count: Int = 1
    ratio: Number = 1.0
    flag: bool = False
    name: str = ""
    mode: Literal["fast", "safe"] = "fast"


class _TypedTypes:
    @hookimpl
    def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
        register(PluginType(name="typed", node="x:Y", config=_TypedConfig))


_TYPED = discover(extra=[_TypedTypes()], entry_points=False)
#: The value is on line 6 (column 13 for "size").
_TYPED_PIPELINE = "version: 1\nnodes:\n  t:\n    plugin: typed\n    config:\n      {}: {}\n"
#: How a text reaches a value: from the environment, quoted or not, or as a default.
_ROUTES = {"variable": "${V}", "quoted": '"${V}"', "default": "${UNSET:-TEXT}"}


def _typed(field: str, text: str, route: str) -> ResolvedPipeline:
    value = _ROUTES[route].replace("TEXT", text)
    return validate_text(
        _TYPED_PIPELINE.format(field, value), file="p.yaml", registry=_TYPED, env={"V": text}
    )


@pytest.mark.parametrize("route", list(_ROUTES))
@pytest.mark.parametrize(
    ("field", "text", "expected"),
    [
        ("size", "8GiB", 8 * 1024**3),
        ("size", "1048576", 1048576),
        ("size", "1.5 KiB", 1536),
        ("count", "12", 12),
        ("count", "-3", -3),
        ("ratio", "0.5", 0.5),
        ("ratio", "1e3", 1000.0),
        ("flag", "true", True),
        ("flag", "false", False),
        ("mode", "safe", "safe"),
        ("name", "123", "123"),
        ("name", "true", "true"),
        ("name", "null", "null"),
        ("name", "1e3", "1e3"),
        ("name", "[1, 2]", "[1, 2]"),
        ("name", "!!python/object/apply:os.system [echo pwned]", None),
        ("name", "&anchor *alias", None),
    ],
)
def test_a_variable_is_text_that_a_typed_field_converts(
    route: str, field: str, text: str, expected: Any
) -> None:
    config = _typed(field, text, route).node("t").config
    assert getattr(config, field) == (text if expected is None else expected)


@pytest.mark.parametrize("route", list(_ROUTES))
@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("count", "[1, 2]", 'expected an integer, got "[1, 2]"'),
        ("count", "1e3", 'expected an integer, got "1e3"'),
        ("count", "!!int 3", 'expected an integer, got "!!int 3"'),
        ("count", "true", 'expected an integer, got "true"'),
        ("ratio", "nan", 'expected a finite number, got "nan"'),
        ("ratio", "true", 'expected a number, got "true"'),
        ("flag", "[true]", 'expected true or false, got "[true]"'),
        (
            "mode",
            "[fast]",
            '"[fast]" is not allowed (did you mean "fast"?); expected one of "fast", "safe"',
        ),
        ("size", "[1]", 'expected a size such as 8GiB, 512MB or a number of bytes, got "[1]"'),
        (
            "size",
            "1e30 GiB",
            'expected a size unit such as B, KB, MB, GB, KiB, MiB or GiB, got "1e30 GiB"',
        ),
        ("size", "2EiB", 'expected a size of at most 1EiB (no machine holds more), got "2EiB"'),
    ],
)
def test_a_variable_a_typed_field_cannot_convert_is_located_at_its_value(
    route: str, field: str, text: str, message: str
) -> None:
    with pytest.raises(PipelineInvalid) as info:
        _typed(field, text, route)
    column = len(f"      {field}: ") + 1
    assert str(info.value) == f"p.yaml:6:{column}: nodes.t.config.{field}: {message}"


@pytest.mark.parametrize(
    ("written", "shown"),
    [
        ("99999999999999999999999", "99999999999999999999999"),
        ("1152921504606846977", "1152921504606846977"),
        ("2EiB", '"2EiB"'),
        ("1.5 EiB", '"1.5 EiB"'),
        ("16000000 TiB", '"16000000 TiB"'),
        ("'1180591620717411303424'", '"1180591620717411303424"'),
    ],
)
def test_a_size_larger_than_any_machine_is_refused_where_it_is(written: str, shown: str) -> None:
    with pytest.raises(PipelineInvalid) as info:
        validate_text(_TYPED_PIPELINE.format("size", written), file="p.yaml", registry=_TYPED)
    assert str(info.value) == (
        "p.yaml:6:13: nodes.t.config.size: expected a size of at most 1EiB (no machine holds "
        f"more), got {shown}"
    )


@pytest.mark.parametrize("written", ["1EiB", "1152921504606846976", "1024 PiB"])
def test_a_size_of_one_eib_is_the_largest_valid(written: str) -> None:
    pipeline = validate_text(_TYPED_PIPELINE.format("size", written), registry=_TYPED)
    assert pipeline.node("t").config.size == 2**60  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- #
# plugins and keys
# --------------------------------------------------------------------------- #


def test_unknown_plugin_suggests_and_lists_installed(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a:
            plugin: cahce
        """
    ) == [
        'p.yaml:4:13: nodes.a.plugin: unknown plugin "cahce" (did you mean "cache"?); '
        'installed: "blend", "cache", "tracker", "vllm"'
    ]


def test_unknown_plugin_without_a_close_match_lists_installed(problems: Check) -> None:
    assert problems("version: 1\nnodes:\n  a: {plugin: zzz}\n") == [
        'p.yaml:3:15: nodes.a.plugin: unknown plugin "zzz"; '
        'installed: "blend", "cache", "tracker", "vllm"'
    ]


def test_unknown_keys_in_node_and_in_plugin_config(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a:
            plugin: cache
            neds: [b]
            config:
              capacity: 1GiB
              evicton: lru
        """
    ) == [
        'p.yaml:5:5: nodes.a.neds: unknown key "neds" (did you mean "needs"?); valid keys: '
        '"config", "description", "enabled", "needs", "on_error", "plugin", "role", "sides"',
        'p.yaml:8:7: nodes.a.config.evicton: unknown key "evicton" (did you mean "eviction"?); '
        'valid keys: "capacity", "checksums", "eviction", "min_blocks"',
    ]


def test_unknown_top_level_key(problems: Check) -> None:
    keys = ", ".join(f'"{k}"' for k in sorted(Pipeline.model_fields))
    assert problems("version: 1\nnodes: {a: {plugin: tracker}}\nload_ordr: [a]\n") == [
        'p.yaml:3:1: load_ordr: unknown key "load_ordr" (did you mean "load_order"?); '
        f"valid keys: {keys}"
    ]


def test_wrong_types(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a:
            plugin: cache
            config:
              capacity: lots
              min_blocks: many
              checksums: maybe
          b: 5
          c: {plugin: cache, config: [capacity]}
        load_order: a
        """
    ) == [
        "p.yaml:6:17: nodes.a.config.capacity: expected a size such as 8GiB, 512MB or a number "
        'of bytes, got "lots"',
        'p.yaml:7:19: nodes.a.config.min_blocks: expected an integer, got "many"',
        'p.yaml:8:18: nodes.a.config.checksums: expected true or false, got "maybe"',
        "p.yaml:9:6: nodes.b: expected a mapping, got 5",
        "p.yaml:10:30: nodes.c.config: expected a mapping, got ['capacity']",
        'p.yaml:11:13: load_order: expected a list, got "a"',
    ]


def test_missing_required_keys_are_reported_at_the_key_that_lacks_them(problems: Check) -> None:
    assert problems(
        """\
        nodes:
          a:
            config: {capacity: 1GiB}
          b:
            plugin: cache
            config:
              eviction: lru
        """
    ) == [
        'p.yaml:1:1: <root>: missing required key "version"',
        'p.yaml:2:3: nodes.a: missing required key "plugin"',
        'p.yaml:6:5: nodes.b.config: missing required key "capacity"',
    ]


def test_config_with_every_option_commented_out_means_no_options(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a:
            plugin: cache
            config:
              # capacity: 1GiB
        """
    ) == ['p.yaml:5:5: nodes.a.config: missing required key "capacity"']


def test_bad_enum_values_suggest_and_list_choices(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        kv_role: kv_prod
        load_policy: longest
        nodes:
          a: {plugin: cache, role: loader, config: {capacity: 1GiB, eviction: lfu}}
        """
    ) == [
        'p.yaml:2:10: kv_role: "kv_prod" is not allowed (did you mean "kv_producer"?); '
        'expected one of "kv_both", "kv_consumer", "kv_producer"',
        'p.yaml:3:14: load_policy: "longest" is not allowed (did you mean "longest_hit"?); '
        'expected one of "first_hit", "longest_hit", "ranges"',
        'p.yaml:5:28: nodes.a.role: "loader" is not allowed (did you mean "load"?); '
        'expected one of "both", "load", "save", "service", "transport"',
        'p.yaml:5:71: nodes.a.config.eviction: "lfu" is not allowed (did you mean "lru"?); '
        'expected one of "fifo", "lru"',
    ]


def test_unsupported_version_and_empty_nodes(problems: Check) -> None:
    assert problems("version: 2\nnodes: {}\n") == [
        "p.yaml:1:10: version: pipeline format version 2 is not supported; expected 1",
        "p.yaml:2:8: nodes: a pipeline needs at least one node",
    ]


def test_hma_on_is_the_string_on_not_a_yaml_1_1_boolean(valid: Valid) -> None:
    pipeline = valid(
        """\
        version: 1
        hma: on
        nodes:
          a: {plugin: vllm, config: {connector: NixlConnector}}
        """
    )
    assert pipeline.hma is True


def test_sizes_parse_as_bytes(valid: Valid) -> None:
    pipeline = valid(
        """\
        version: 1
        nodes:
          a: {plugin: cache, config: {capacity: 8GiB}}
          b: {plugin: cache, config: {capacity: 1.5 MB}}
          c: {plugin: cache, config: {capacity: 4096}}
          d: {plugin: cache, config: {capacity: 2gib}}
        """
    )
    assert [pipeline.node(n).config.capacity for n in "abcd"] == [
        8 * 1024**3,
        1_500_000,
        4096,
        2 * 1024**3,
    ]


def test_bad_size_unit(problems: Check) -> None:
    assert problems("version: 1\nnodes: {a: {plugin: cache, config: {capacity: 8XiB}}}\n") == [
        "p.yaml:2:47: nodes.a.config.capacity: expected a size unit such as B, KB, MB, GB, KiB, "
        'MiB or GiB, got "8XiB"'
    ]


# --------------------------------------------------------------------------- #
# node ids and dependencies
# --------------------------------------------------------------------------- #


def test_invalid_node_id(problems: Check) -> None:
    assert problems("version: 1\nnodes:\n  1st cache: {plugin: tracker}\n") == [
        'p.yaml:3:3: nodes["1st cache"]: node ids start with a letter and use letters, digits, '
        "'-' and '_' only"
    ]


def test_needs_naming_a_missing_node_suggests_the_close_one(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          tracker: {plugin: tracker}
          blend:
            plugin: blend
            needs: [tracker, trackr]
        """
    ) == [
        'p.yaml:6:22: nodes.blend.needs[1]: node "trackr" does not exist '
        '(did you mean "tracker"?); nodes: "blend", "tracker"'
    ]


def test_self_dependency_is_one_problem_not_also_a_cycle(problems: Check) -> None:
    text = "version: 1\nnodes:\n  a: {plugin: cache, needs: [a], config: {capacity: 1}}\n"
    assert problems(text) == ["p.yaml:3:30: nodes.a.needs[0]: a node cannot need itself"]


def test_cycle_is_printed_as_its_full_path(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: tracker, needs: [b]}
          b: {plugin: tracker, needs: [c]}
          c: {plugin: tracker, needs: [a]}
          d: {plugin: tracker, needs: [a]}
        """
    ) == ["p.yaml:3:32: nodes.a.needs[0]: dependency cycle: a -> b -> c -> a"]


def test_a_pipeline_with_every_node_disabled(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: tracker, enabled: false}
          b: {plugin: cache, enabled: false, config: {capacity: 1GiB}}
        """
    ) == ["p.yaml:3:3: nodes: every node is disabled; enable at least one"]


def test_needing_a_disabled_node(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          t: {plugin: tracker, enabled: false}
          b: {plugin: blend, needs: [t]}
        """
    ) == [
        # The tracker is off, so the blend node is left without a model too.
        "p.yaml:4:29: nodes.b.needs: needs the model but no dependency provides it "
        "(add a model-tracker node)",
        'p.yaml:4:30: nodes.b.needs[0]: node "t" is disabled',
    ]


# --------------------------------------------------------------------------- #
# load order, save targets and roles
# --------------------------------------------------------------------------- #


def test_load_order_and_save_to_problems(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          t: {plugin: tracker}
          c: {plugin: cache, config: {capacity: 1GiB}}
        load_order: [c, cc, c, t]
        save_to: [t, c, c]
        """
    ) == [
        'p.yaml:5:17: load_order[1]: node "cc" does not exist (did you mean "c"?); nodes: "c", "t"',
        'p.yaml:5:21: load_order[2]: node "c" is listed twice',
        'p.yaml:5:24: load_order[3]: node "t" has role "service", which does not load; '
        'roles that load: "both", "load", "transport"',
        'p.yaml:6:11: save_to[0]: node "t" has role "service", which does not save; '
        'roles that save: "both", "save", "transport"',
        'p.yaml:6:17: save_to[2]: node "c" is listed twice',
    ]


def test_role_the_plugin_cannot_take(problems: Check) -> None:
    assert problems("version: 1\nnodes:\n  t: {plugin: tracker, role: load}\n") == [
        'p.yaml:3:30: nodes.t.role: plugin "tracker" cannot take role "load"; '
        'expected one of "service"'
    ]


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


# --------------------------------------------------------------------------- #
# hostile input: strict values, escaped output, Python data, plugin failures
# --------------------------------------------------------------------------- #

_NATIVE = """\
version: 1
nodes:
  n:
    plugin: vllm
    config: {connector: X, kv_port: %s}
"""


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("true", "expected an integer, got true"),
        ("false", "expected an integer, got false"),
        ("-1", "input should be greater than or equal to 1 (got -1)"),
        ("0", "input should be greater than or equal to 1 (got 0)"),
        ("65536", "input should be less than or equal to 65535 (got 65536)"),
        ("99999999", "input should be less than or equal to 65535 (got 99999999)"),
        (".inf", "expected a finite number, got inf"),
    ],
)
def test_kv_port_is_a_port(problems: Check, value: str, message: str) -> None:
    assert problems(_NATIVE % value) == [f"p.yaml:5:37: nodes.n.config.kv_port: {message}"]


def test_kv_port_range_ends_are_valid(valid: Valid) -> None:
    for port in ("1", "65535"):
        assert valid(_NATIVE % port).nodes[0].config.kv_port == int(port)  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["true", "false", "1.0", "'1'", "-1", "2", "null"])
def test_version_is_exactly_the_integer_1(problems: Check, value: str) -> None:
    shown = {"'1'": '"1"'}.get(value, value)
    assert problems(_NATIVE.replace("version: 1", f"version: {value}") % "8000") == [
        f"p.yaml:1:10: version: pipeline format version {shown} is not supported; expected 1"
    ]


_NON_FINITE_AT = {
    "version": _NATIVE.replace("version: 1", "version: VALUE") % "8000",
    "string-field": _NATIVE % "8000" + "    description: VALUE\n",
    "port": _NATIVE % "VALUE",
    "extra-config": _NATIVE % "8000, extra_config: {x: [VALUE]}",
}


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e+400"])
@pytest.mark.parametrize("where", _NON_FINITE_AT.values(), ids=list(_NON_FINITE_AT))
def test_no_value_is_infinite_or_nan(problems: Check, value: str, where: str) -> None:
    # JSON has neither: vLLM's config would get null in their place.
    found = problems(where.replace("VALUE", value))
    shown = {".inf": "inf", "-.inf": "-inf", ".nan": "nan", "1.0e+400": "inf"}[value]
    assert len(found) == 1, found
    assert re.fullmatch(rf"p\.yaml:\d+:\d+: \S+: expected a finite number, got {shown}", found[0])


_UNSAFE_TEXT = [
    "\n",
    "\r",
    "\x1b",
    "\x07",
    "\x08",
    "\x00",
    "\x7f",
    "\x85",
    "\x9b",
    "\u202e",
    "\u2066",
    "\u200b",
    "\u2028",
    "\u2029",
    "\ufeff",
    "\U000e0041",
    "\udce9",
]
#: What a YAML file can carry (a lone surrogate it cannot; the loader tests cover those).
_YAML_UNSAFE_TEXT = [c for c in _UNSAFE_TEXT if not 0xD800 <= ord(c) <= 0xDFFF]


@pytest.mark.parametrize("char", _UNSAFE_TEXT, ids=[f"U+{ord(c):04X}" for c in _UNSAFE_TEXT])
def test_escape_makes_every_unsafe_character_visible(char: str) -> None:
    shown = escape(f"a{char}b")
    assert char not in shown and shown.startswith("a\\") and shown.endswith("b")
    assert shown.isprintable() and shown.isascii()


def test_escape_leaves_ordinary_text_alone() -> None:
    text = 'plain "quoted" \\ back-slash, caf\u00e9 \u4e2d\u6587 \U0001f600'
    assert escape(text) == text


@pytest.mark.parametrize(
    "char", _YAML_UNSAFE_TEXT, ids=[f"U+{ord(c):04X}" for c in _YAML_UNSAFE_TEXT]
)
def test_user_text_cannot_forge_or_restyle_problem_lines(problems: Check, char: str) -> None:
    fake = f"{char}p.yaml:1:1: <root>: all good{char}"
    # In a double-quoted YAML string, as an escape: the file itself stays printable.
    escaped = "".join(c if c.isascii() and c.isprintable() else f"\\U{ord(c):08x}" for c in fake)
    found = problems(
        f"""\
        version: 1
        nodes:
          n:
            plugin: "{escaped}"
          m:
            plugin: cache
            config: {{capacity: 1GiB}}
            "{escaped}": 1
        """
    )
    assert len(found) == 2
    for line in found:
        assert "\n" not in line and char not in line and line.isprintable()
    assert found[0].startswith('p.yaml:4:13: nodes.n.plugin: unknown plugin "')
    assert found[1].startswith("p.yaml:8:5: nodes.m[")


def test_a_self_referencing_dict_is_pipeline_invalid(registry: Registry) -> None:
    data: dict[str, Any] = {"version": 1, "nodes": {"a": {"plugin": "cache"}}}
    data["nodes"]["a"]["config"] = data
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline(data, registry=registry)
    assert [str(p) for p in info.value.problems] == [
        "<pipeline>: nodes.a.config: refers to a mapping or list that contains it (a cycle)"
    ]
    cyclic_list: list[Any] = []
    cyclic_list.append(cyclic_list)
    with pytest.raises(PipelineInvalid, match=r"needs\[0\]: refers to a mapping or list"):
        load_pipeline(
            {"version": 1, "nodes": {"a": {"plugin": "cache", "needs": cyclic_list}}},
            registry=registry,
        )


def test_deep_or_huge_python_data_is_pipeline_invalid(registry: Registry) -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(10000):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(PipelineInvalid, match="nested deeper than 100 levels"):
        load_pipeline(
            {"version": 1, "nodes": {"a": {"plugin": "cache", "config": deep}}}, registry=registry
        )
    with pytest.raises(PipelineInvalid, match="more than 100,000 values"):
        load_pipeline({"version": 1, "nodes": {}, "x": list(range(200_000))}, registry=registry)


class _Custom:
    def __repr__(self) -> str:
        raise RuntimeError("a repr that raises must not be called")


def _recursive_list() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


_NOT_PLAIN = "expected a mapping, list, string, number, true/false or null, got an object of type"
#: Python values that are not data, and the problem each is.
_NOT_DATA: dict[str, tuple[Callable[[], Any], str]] = {
    "object": (object, f"{_NOT_PLAIN} object"),
    "custom-class": (_Custom, f"{_NOT_PLAIN} _Custom"),
    "class": (lambda: int, f"{_NOT_PLAIN} type"),
    "function": (lambda: len, f"{_NOT_PLAIN} builtin_function_or_method"),
    "set": (lambda: {1, 2}, f"{_NOT_PLAIN} set"),
    "frozenset": (lambda: frozenset({1}), f"{_NOT_PLAIN} frozenset"),
    "bytes": (lambda: b"ab", f"{_NOT_PLAIN} bytes"),
    "bytearray": (lambda: bytearray(b"ab"), f"{_NOT_PLAIN} bytearray"),
    "complex": (lambda: 1j, f"{_NOT_PLAIN} complex"),
    "path": (lambda: Path("/tmp"), f"{_NOT_PLAIN} PosixPath"),
    "nan": (lambda: float("nan"), "expected a finite number, got nan"),
    "inf": (lambda: float("inf"), "expected a finite number, got inf"),
    "-inf": (lambda: float("-inf"), "expected a finite number, got -inf"),
    "huge-int": (lambda: 10**5000, "integer of more than 100 digits; at most 100 are read"),
    "int-key": (lambda: {1: "a"}, "mapping keys are strings, not 1"),
    "none-key": (lambda: {None: "a"}, "mapping keys are strings, not null"),
    "tuple-key": (lambda: {(1, 2): "a"}, "mapping keys are strings, not an object of type tuple"),
    "object-key": (
        lambda: {_Custom(): "a"},
        "mapping keys are strings, not an object of type _Custom",
    ),
    "recursive-list": (_recursive_list, "refers to a mapping or list that contains it (a cycle)"),
}
#: Where in a pipeline the value goes, and the dotted key the problem names.
_PLACES: dict[str, tuple[Callable[[Any], dict[str, Any]], str]] = {
    "extra-config": (
        lambda v: {
            "version": 1,
            "nodes": {
                "n": {
                    "plugin": "vllm",
                    "config": {"connector": "X", "extra_config": {"deep": [{"x": v}]}},
                }
            },
        },
        "nodes.n.config.extra_config.deep[0].x",
    ),
    "typed-field": (
        lambda v: {
            "version": 1,
            "nodes": {"n": {"plugin": "vllm", "config": {"connector": "X", "kv_port": v}}},
        },
        "nodes.n.config.kv_port",
    ),
    "pipeline-key": (lambda v: {"version": 1, "nodes": {"n": {"plugin": "vllm"}}, "hma": v}, "hma"),
}


def _where(path: str, message: str) -> str:
    # A cycle is found where the list repeats: one level further down.
    return path + "[0]" if message.endswith("(a cycle)") else path


@pytest.mark.parametrize("place", _PLACES.values(), ids=list(_PLACES))
@pytest.mark.parametrize(("make", "message"), _NOT_DATA.values(), ids=list(_NOT_DATA))
def test_python_values_that_are_not_data_are_pipeline_invalid_where_they_are(
    registry: Registry,
    make: Callable[[], Any],
    message: str,
    place: tuple[Callable[[Any], dict[str, Any]], str],
) -> None:
    pipeline_with, path = place
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline(pipeline_with(make()), registry=registry)
    assert [str(p) for p in info.value.problems] == [
        f"<pipeline>: {_where(path, message)}: {message}"
    ]


@pytest.mark.parametrize(("make", "message"), _NOT_DATA.values(), ids=list(_NOT_DATA))
def test_a_pipeline_model_holding_what_is_not_data_is_pipeline_invalid(
    registry: Registry, make: Callable[[], Any], message: str
) -> None:
    node = Node(plugin="vllm", config={"connector": "X", "extra_config": {"x": make()}})
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline(Pipeline(version=1, nodes={"n": node}), registry=registry)
    path = _where("nodes.n.config.extra_config.x", message)
    if message.endswith("(a cycle)"):
        path += "[0]"  # model_dump copied the outer list: the cycle closes one level down
    assert [str(p) for p in info.value.problems] == [f"<pipeline>: {path}: {message}"]


def test_a_root_key_that_is_not_a_string_is_pipeline_invalid(registry: Registry) -> None:
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline({"version": 1, "nodes": {"n": {"plugin": "vllm"}}, 2: "x"}, registry=registry)  # type: ignore[dict-item]
    assert str(info.value) == "<pipeline>: <root>: mapping keys are strings, not 2"


def test_python_data_of_every_plain_kind_is_valid_and_kept(registry: Registry) -> None:
    extra = {"s": "x", "i": -3, "f": 0.5, "b": True, "n": None, "l": [1, "a"], "t": (1, 2)}
    pipeline = load_pipeline(
        {
            "version": 1,
            "nodes": {"n": {"plugin": "vllm", "config": {"connector": "X", "extra_config": extra}}},
        },
        registry=registry,
    )
    # A tuple is a list, as JSON has it.
    assert pipeline.source["nodes"]["n"]["config"]["extra_config"] == {**extra, "t": [1, 2]}


def test_shared_python_values_are_not_cycles(valid: Valid, registry: Registry) -> None:
    config = {"capacity": "1GiB"}
    pipeline = load_pipeline(
        {
            "version": 1,
            "nodes": {
                "a": {"plugin": "cache", "config": config},
                "b": {"plugin": "cache", "config": config},
            },
        },
        registry=registry,
    )
    assert [n.id for n in pipeline.nodes] == ["a", "b"]


def _chain(count: int, last: str) -> str:
    text = "version: 1\nnodes:\n"
    for i in range(count):
        need = f"n{i + 1}" if i + 1 < count else last
        needs = f", needs: [{need}]" if need else ""
        text += f"  n{i}: {{plugin: cache, config: {{capacity: 1GiB}}{needs}}}\n"
    return text


def test_a_needs_chain_thousands_long_orders_without_recursion(valid: Valid) -> None:
    pipeline = valid(_chain(3000, ""))
    assert [n.id for n in pipeline.nodes] == [f"n{i}" for i in reversed(range(3000))]


def test_a_cycle_thousands_long_is_one_problem(problems: Check) -> None:
    found = problems(_chain(3000, "n0"))
    assert len(found) == 1
    assert found[0].startswith("p.yaml:3:57: nodes.n0.needs[0]: dependency cycle: n0 -> n1 -> ")
    assert found[0].endswith(" -> n2999 -> n0")


def test_messages_list_at_most_twenty_names(problems: Check) -> None:
    found = problems(_chain(100, "missing"))
    assert found == [
        'p.yaml:102:58: nodes.n99.needs[0]: node "missing" does not exist; nodes: '
        + ", ".join(f'"{n}"' for n in sorted(f"n{i}" for i in range(100))[:20])
        + " and 80 more"
    ]


@pytest.mark.parametrize(
    "failure",
    ["raise", "exit", "bad-yield"],
)
@pytest.mark.parametrize("where", ["check", "validator", "capabilities"])
def test_a_failing_plugin_is_an_environment_error_not_a_crash(failure: str, where: str) -> None:
    def fail() -> Any:
        if failure == "exit":
            sys.exit(0)
        if failure == "raise" or where != "check":
            raise RuntimeError("plugin bug")
        return [("not", "a tuple path")]

    class Config(BaseModel):
        x: int = Field(1, validate_default=True)

        @field_validator("x")
        @classmethod
        def _x(cls, value: int) -> int:
            return fail() if where == "validator" else value  # type: ignore[no-any-return]

    class Types:
        @hookimpl
        def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
            register(
                PluginType(
                    name="buggy",
                    node="x:Y",
                    config=Config,
                    check=(lambda *_: fail()) if where == "check" else None,
                    capabilities=(
                        (lambda _: fail()) if where == "capabilities" else Capabilities()
                    ),
                )
            )

    registry = discover(extra=[Types()], entry_points=False)
    with pytest.raises(PluginLoadError, match=r'^plugin "buggy" failed while '):
        validate_text("version: 1\nnodes: {a: {plugin: buggy}}\n", registry=registry)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"config": dict}, 'plugin type "odd": config must be a pydantic model class'),
        ({"config": "Config"}, 'plugin type "odd": config must be a pydantic model class'),
        ({"check": 3}, 'plugin type "odd": check must be callable'),
        (
            {"capabilities": "x"},
            'plugin type "odd": capabilities must be a Capabilities or a function of the config',
        ),
        ({"name": ""}, "a plugin type needs a non-empty string name"),
    ],
)
def test_a_malformed_plugin_type_is_refused_at_discovery(
    kwargs: dict[str, Any], problem: str
) -> None:
    class Types:
        @hookimpl
        def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
            register(PluginType(**{"name": "odd", "node": "x:Y", **kwargs}))

    with pytest.raises(PluginLoadError, match=re.escape(problem)):
        discover(extra=[Types()], entry_points=False)


def test_a_plugin_module_that_exits_while_imported_is_an_environment_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvc_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KV_COMPOSER_PLUGIN_MODULES", "kvc_exits_on_import")
    with pytest.raises(PluginLoadError, match=r"failed to import: SystemExit\(0\)"):
        discover(entry_points=False)
