"""Errors of the schema stage, each node checked on its own: unknown plugins
and keys (with suggestions), wrong types, missing required keys, enum values,
the format version, and sizes.

Test plugin types (``cache``, ``tracker``, ``blend``) and the ``problems``/``valid``
checkers come from conftest; the builtin ``vllm`` type is used as installed.
"""

from __future__ import annotations

from pipeline_checks import Check, Valid

from composer import Pipeline


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
