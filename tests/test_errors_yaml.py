"""Errors of the first stage, parsing the YAML: syntax errors with where the
construct started, tabs, duplicate keys, unsupported tags, empty and non-mapping
documents. Each problem is checked for its exact location, dotted path and message.

Test plugin types (``cache``, ``tracker``, ``blend``) and the ``problems``
checker come from conftest.
"""

from __future__ import annotations

import yaml
from pipeline_checks import Check


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
