"""The YAML loader: marks for every path, env expansion, safety, and file reading."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer import PipelineInvalid, Registry, load_pipeline
from composer.loader import EnvProblem, expand_env, load_yaml


def test_marks_locate_values_and_keys() -> None:
    text = "version: 1\nnodes:\n  a:\n    plugin: x\n    needs: [b, c]\n"
    data, marks, problems = load_yaml(text)
    assert problems == []
    assert data == {"version": 1, "nodes": {"a": {"plugin": "x", "needs": ["b", "c"]}}}
    assert marks.locate(("nodes", "a", "plugin")) == (4, 13)
    assert marks.locate(("nodes", "a", "plugin"), key=True) == (4, 5)
    assert marks.locate(("nodes", "a", "needs", 1)) == (5, 16)
    # A path that is not in the file falls back to its nearest ancestor.
    assert marks.locate(("nodes", "a", "config", "capacity")) == (4, 5)


def test_only_true_and_false_are_booleans() -> None:
    data, _, _ = load_yaml("a: on\nb: off\nc: yes\nd: no\ne: true\nf: False\ng: y\n")
    assert data == {"a": "on", "b": "off", "c": "yes", "d": "no", "e": True, "f": False, "g": "y"}


def test_merge_keys_and_aliases_resolve() -> None:
    data, _, problems = load_yaml(
        "x: &base {plugin: cache, config: {capacity: 1}}\n"
        "nodes:\n  a: *base\n  b:\n    <<: *base\n    role: load\n"
    )
    assert problems == []
    assert data["nodes"]["a"] == {"plugin": "cache", "config": {"capacity": 1}}
    assert data["nodes"]["b"] == {"plugin": "cache", "config": {"capacity": 1}, "role": "load"}


def test_non_scalar_keys_are_problems_not_crashes() -> None:
    data, _, problems = load_yaml("nodes:\n  ? [a, b]\n  : 1\n  c: 2\n")
    assert data == {"nodes": {"c": 2}}
    assert [(p.path, p.message, p.line, p.column) for p in problems] == [
        (("nodes",), "mapping keys must be plain scalars", 2, 5)
    ]


def test_scalar_keys_become_strings() -> None:
    data, _, _ = load_yaml("1: a\n2.5: b\ntrue: c\n")
    assert data == {"1": "a", "2.5": "b", "True": "c"}


def test_more_than_one_document_is_a_syntax_error() -> None:
    data, _, problems = load_yaml("version: 1\n---\nversion: 2\n")
    assert data is None
    assert [(p.message, p.line) for p in problems] == [
        (
            "YAML syntax error: but found another document "
            "(expected a single document in the stream at line 1, column 1)",
            2,
        )
    ]


def test_deep_nesting_is_reported() -> None:
    _, _, problems = load_yaml("a: " + "[" * 5000 + "]" * 5000)
    assert [(p.message, p.line, p.column) for p in problems] == [
        ("YAML error: nested deeper than 100 levels", 1, 103)
    ]


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A}", {"A": "x"}, "x"),
        ("${A:-d}", {}, "d"),
        ("${A:-d}", {"A": ""}, "d"),  # empty counts as unset when a default is given
        ("${A}", {"A": ""}, ""),  # ... and is a value when it is not
        ("${A:-}", {}, ""),
        ("$${A}", {"A": "x"}, "${A}"),  # $$ escapes
        ("pre-${A}-${B:-2}", {"A": "1"}, "pre-1-2"),
        ("$A and $", {}, "$A and $"),  # only ${...} is a variable
    ],
)
def test_expand_env(text: str, env: dict[str, str], expected: str) -> None:
    assert expand_env(text, env) == expected


def test_expand_env_raises_for_unset() -> None:
    with pytest.raises(EnvProblem, match=r"\$\{A\} is not set"):
        expand_env("${A}", {})


def test_expanded_unquoted_values_take_yaml_types_quoted_stay_strings() -> None:
    data, _, problems = load_yaml(
        'i: ${N}\nf: ${F}\nb: ${B}\nn: ${X:-null}\ns: "${N}"\nt: ${T}\n',
        env={"N": "8", "F": "0.5", "B": "true", "T": "a: b"},
    )
    assert problems == []
    # A value that would read as a mapping stays the text it was.
    assert data == {"i": 8, "f": 0.5, "b": True, "n": None, "s": "8", "t": "a: b"}


def test_load_pipeline_reports_unreadable_files(tmp_path: Path, registry: Registry) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline(missing, registry=registry)
    assert str(info.value) == (
        f"{missing}: <root>: cannot read pipeline file: No such file or directory"
    )

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("version: 1\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline(latin1, registry=registry)
    assert str(info.value) == (
        f"{latin1}:2:6: <root>: pipeline file is not UTF-8 text: byte 0xe9 cannot be decoded"
    )

    with pytest.raises(PipelineInvalid) as info:
        load_pipeline(tmp_path, registry=registry)
    assert str(info.value) == f"{tmp_path}: <root>: cannot read pipeline file: Is a directory"


def test_load_pipeline_from_a_mapping_and_a_model(registry: Registry) -> None:
    from composer import Node, Pipeline

    data = {"version": 1, "nodes": {"t": {"plugin": "tracker"}}}
    assert [n.id for n in load_pipeline(data, registry=registry).nodes] == ["t"]
    model = Pipeline(version=1, nodes={"t": Node(plugin="tracker")})
    assert load_pipeline(model, registry=registry).node("t").role == "service"
    with pytest.raises(PipelineInvalid) as info:
        load_pipeline({"version": 1, "nodes": {"t": {"plugin": "trackr"}}}, registry=registry)
    assert [str(p) for p in info.value.problems] == [
        '<pipeline>: nodes.t.plugin: unknown plugin "trackr" (did you mean "tracker"?); '
        'installed: "blend", "cache", "tracker", "vllm"'
    ]


def test_text_that_is_not_valid_unicode() -> None:
    data, _, problems = load_yaml("version: 1\nnodes: caf\udce9\n")
    assert data is None
    assert [(p.message, p.line, p.column) for p in problems] == [
        ("the text is not valid Unicode", 2, 11)
    ]
