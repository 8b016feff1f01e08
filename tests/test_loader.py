"""The YAML loader: marks for every path, env expansion, safety, and file reading."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer import PipelineInvalid, Registry, load_pipeline
from composer.loader import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NUMBER_CHARS,
    MAX_VALUES,
    EnvProblem,
    FileProblem,
    decode_pipeline,
    expand_env,
    load_yaml,
    read_pipeline_file,
)


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


#: Values that YAML would read as something else than text, had they been in the file.
_YAML_LOOKING = [
    "8",
    "1048576",
    "0.5",
    "1e3",
    "0x10",
    "true",
    "null",
    "~",
    "",
    "[1, 2]",
    "{a: 1}",
    "a: b",
    "- x",
    "!!python/object/apply:os.system [echo pwned]",
    "!!int abc",
    "&anchor x",
    "*alias",
    "<<",
    "|\n  block",
    "'quoted'",
    '"double"',
    "# comment",
    "--- x",
    "9" * 5000,
]
_STYLES = {"plain": "{}", "single": "'{}'", "double": '"{}"'}


@pytest.mark.parametrize("style", sorted(_STYLES))
@pytest.mark.parametrize("value", _YAML_LOOKING, ids=[repr(v)[:30] for v in _YAML_LOOKING])
@pytest.mark.parametrize("around", ["{}", "<{}>"], ids=["whole", "inside-text"])
def test_a_variable_expands_to_text_whatever_it_looks_like(
    value: str, style: str, around: str
) -> None:
    written = _STYLES[style].format(around.format("${V}"))
    data, _, problems = load_yaml(f"a: {written}\n", env={"V": value})
    assert problems == []
    assert data == {"a": around.format(value)}


#: Defaults a plain (unquoted) value can hold: the style that YAML would type.
_PLAIN_DEFAULTS = ["8", "0.5", "1e3", "true", "null", "~", "[1, 2]", "!!int abc", "&a x", "*a"]


@pytest.mark.parametrize("default", _PLAIN_DEFAULTS)
def test_a_default_expands_to_text_whatever_it_looks_like(default: str) -> None:
    data, _, problems = load_yaml(f"a: ${{UNSET:-{default}}}\n", env={})
    assert problems == []
    assert data == {"a": default}


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


# --------------------------------------------------------------------------- #
# hostile input: every limit applies while loading and is located
# --------------------------------------------------------------------------- #


def _bomb(fan: int, levels: int) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * fan)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nkey: *a{levels}\n"


def _merge_doubling(levels: int) -> str:
    text = "b0: &b0 {k0: 0}\n"
    for i in range(1, levels + 1):
        text += f"b{i}: &b{i}\n  <<: [*b{i - 1}, *b{i - 1}]\n  k{i}: {i}\n"
    return text


@pytest.mark.parametrize(
    ("text", "where"),
    [
        # 10**9 values: stops at the alias whose expansion crosses MAX_VALUES.
        (_bomb(10, 9), (5, 45)),
        (_bomb(2, 40), (15, 18)),
        (_bomb(100, 4), (3, 50)),
        (
            "m0: &m0 {a: 1, b: 2}\n"
            + "".join(
                f"m{i}: &m{i} {{{', '.join(f'k{j}: *m{i - 1}' for j in range(10))}}}\n"
                for i in range(1, 8)
            ),
            (6, 14),
        ),
        (_merge_doubling(40), (39, 14)),
    ],
    ids=["laughs-10x9", "laughs-2x40", "laughs-100x4", "mappings", "merge-doubling"],
)
def test_alias_expansion_stops_at_the_limit_where_it_is_crossed(
    text: str, where: tuple[int, int]
) -> None:
    data, _, problems = load_yaml(text)
    assert data is None
    assert [(p.message, (p.line, p.column)) for p in problems] == [
        (
            f"YAML error: the document expands to more than {MAX_VALUES:,} values "
            "(an alias counts every value it stands for, at each use)",
            where,
        )
    ]


def test_aliases_within_the_limit_expand() -> None:
    data, _, problems = load_yaml(_bomb(10, 3))
    assert problems == []
    assert len(data["key"]) == 10 and data["key"][0][0][0] == ["x"] * 10


@pytest.mark.parametrize(
    "text",
    ["a: &a [1, *a]\n", "a: &a {b: *a}\n", "a: &a {b: {c: [*a]}}\n", "a: &a {<<: *a}\n"],
)
def test_an_alias_inside_its_own_anchor_is_refused(text: str) -> None:
    _, _, problems = load_yaml(text)
    assert [p.message for p in problems] == [
        "YAML error: alias 'a' is inside the node it refers to"
    ]
    assert problems[0].line == 1


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("a: " + "[" * 30000 + "]" * 30000, (1, 103)),
        ("a: " + "{a: " * 30000 + "1" + "}" * 30000, (1, 400)),
        ("".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "x\n", (101, 101)),
        ("a:\n" + "- " * 500 + "x\n", (2, 199)),
    ],
    ids=["flow-sequences", "flow-mappings", "block-mappings", "block-sequences"],
)
def test_nesting_past_the_limit_is_located_not_a_crash(text: str, where: tuple[int, int]) -> None:
    _, _, problems = load_yaml(text)
    assert [(p.message, (p.line, p.column)) for p in problems] == [
        (f"YAML error: nested deeper than {MAX_DEPTH} levels", where)
    ]


def test_nesting_up_to_the_limit_loads() -> None:
    data, _, problems = load_yaml("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert problems == []
    for _ in range(MAX_DEPTH - 1):
        data = data[0]
    assert data == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("!!int abc", "'abc' is not a valid !!int"),
        ("!!float abc", "'abc' is not a valid !!float"),
        ("!!bool maybe", "'maybe' is not a valid !!bool"),
        ("!!int 0xZZ", "'0xZZ' is not a valid !!int"),
        ("!!int ''", "'' is not a valid !!int"),
        ("!!int _", "'_' is not a valid !!int"),
        ("!!float ''", "'' is not a valid !!float"),
        ("!!int 1:x", "'1:x' is not a valid !!int"),
        ("!!int {a: 1}", "YAML tag !!int does not fit this value"),
        ("!!map x", "YAML tag !!map does not fit this value"),
        ("!!seq x", "YAML tag !!seq does not fit this value"),
        ("!!str [a]", "YAML tag !!str does not fit this value"),
        ("!!binary aGk=", "unsupported YAML tag !!binary"),
        ("!mine x", "unsupported YAML tag !mine"),
    ],
)
def test_every_tag_error_is_located_at_its_value(value: str, message: str) -> None:
    data, _, problems = load_yaml(f"version: 1\nport: {value}\n")
    assert [(p.message, p.path, p.line, p.column) for p in problems] == [(message, ("port",), 2, 7)]
    assert data == {"version": 1, "port": None}


def test_a_bad_tag_on_a_key_is_located_too() -> None:
    _, _, problems = load_yaml("a: 1\n!!bool maybe: 2\n")
    assert [(p.message, p.line, p.column) for p in problems] == [
        ("'maybe' is not a valid !!bool", 2, 1),
        ("mapping keys must be plain scalars", 2, 1),
    ]


@pytest.mark.parametrize(
    "number",
    [
        "9" * 5000,
        "-" + "9" * 5000,
        "0x" + "f" * 200,
        "1" * 200 + ".5",
        "1." + "5" * 200 + "e+5",
        "_".join(["999"] * 100),
    ],
)
def test_numbers_wider_than_the_limit_are_refused_where_they_are(number: str) -> None:
    _, _, problems = load_yaml(f"a: 1\nb: {number}\n? {number}\n: 1\n")
    message = (
        f"number with {len(number):,} characters; at most {MAX_NUMBER_CHARS} are read "
        "(quote it if it is text)"
    )
    assert [(p.message, p.line, p.column) for p in problems] == [
        (message, 2, 4),
        (message, 3, 3),
        ("mapping keys must be plain scalars", 3, 3),
    ]


def test_an_environment_value_that_is_not_utf8_is_reported_at_its_use() -> None:
    # os.environ keeps undecodable bytes as lone surrogates.
    _, _, problems = load_yaml("a: 1\nb: x${BAD}\n", env={"BAD": "caf\udce9"})
    assert [(p.message, p.line, p.column) for p in problems] == [
        ("environment variable ${BAD} is not UTF-8 text", 2, 4)
    ]


_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\{")


def _reference_expand(text: str, env: dict[str, str]) -> str:
    """The expansion as a regular expression (quadratic on long input, hence the scanner)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        if name is None or "${" in (default or ""):  # a "${" that begins no reference
            raise EnvProblem(m.group(0))
        if name in env and (env[name] != "" or default is None):
            return env[name]
        if default is not None:
            return default
        raise EnvProblem(name)

    return _REFERENCE.sub(sub, text)


@settings(max_examples=3000, deadline=None)
@given(text=st.text(alphabet="${}:-AB_1 x", max_size=40))
def test_expand_env_means_what_the_regular_expression_means(text: str) -> None:
    env = {"A": "a", "B": "", "A_1": "z"}
    try:
        expected: str | None = _reference_expand(text, env)
    except EnvProblem:
        expected = None
    try:
        got: str | None = expand_env(text, env)
    except EnvProblem:
        got = None
    assert got == expected


#: Every way a "${" can fail to be a reference, each also as a long run (linear time).
_BROKEN_REFERENCES = {
    "unclosed": ("${", "unterminated reference"),
    "unclosed-name": ("${A", "unterminated reference"),
    "unclosed-default": ("${A:-x", "unterminated reference"),
    "unclosed-after-text": ("ok ${A} then ${", "unterminated reference"),
    "empty": ("${}", "is not ${NAME} or ${NAME:-default}"),
    "digit-first": ("${1A}", "is not ${NAME} or ${NAME:-default}"),
    "space": ("${ A}", "is not ${NAME} or ${NAME:-default}"),
    "shell-dash": ("${A-x}", "is not ${NAME} or ${NAME:-default}"),
    "colon-only": ("${A:x}", "is not ${NAME} or ${NAME:-default}"),
    "newline": ("${A\n}", "is not ${NAME} or ${NAME:-default}"),
    "nested-default": ("${A:-${B}}", "a default cannot hold another ${...}"),
}


@pytest.mark.parametrize("lead", ["", "${A}$$ " * 10_000], ids=["alone", "after-20k"])
@pytest.mark.parametrize(
    ("text", "message"), _BROKEN_REFERENCES.values(), ids=list(_BROKEN_REFERENCES)
)
def test_a_dollar_brace_that_begins_no_reference_is_an_error(
    text: str, message: str, lead: str
) -> None:
    with pytest.raises(EnvProblem) as info:
        expand_env(lead + text, {"A": "x", "B": "y"})
    assert message in str(info.value)
    assert len(str(info.value)) < 200  # the value is quoted, not repeated


@pytest.mark.parametrize(
    "text", ["${A:-" * 20_000, "${" * 20_000, "$$${" * 20_000, "${" + "A" * 20_000, "${}" * 20_000]
)
def test_long_runs_of_broken_references_are_errors(text: str) -> None:
    # Once quadratic with a regular expression; the hostile corpus times these.
    with pytest.raises(EnvProblem):
        expand_env(text, {"A": "x"})


@pytest.mark.parametrize(
    "text", ["$$" * 20_000, "$${" * 20_000, "$" * 20_001, "$A " * 20_000, "$}" * 20_000]
)
def test_dollars_that_begin_no_reference_stay_text(text: str) -> None:
    assert expand_env(text, {}) == text.replace("$$", "$")


@pytest.mark.parametrize(
    ("text", "message"), _BROKEN_REFERENCES.values(), ids=list(_BROKEN_REFERENCES)
)
def test_a_broken_reference_is_located_at_its_value(text: str, message: str) -> None:
    quoted = text.replace("\\", "\\\\").replace("\n", "\\n")
    data, _, problems = load_yaml(f'a:\n  b: [1, "{quoted}"]\n', env={"A": "x"})
    assert [(p.path, p.line, p.column, p.replaces_value) for p in problems] == [
        (("a", "b", 1), 2, 10, True)
    ]
    assert message in problems[0].message


def test_a_merge_override_is_not_a_duplicate_key() -> None:
    data, _, problems = load_yaml(
        "base: &base {x: 1, y: 2}\n"
        "one:\n  <<: *base\n  x: 3\n"
        "two:\n  x: 4\n  <<: [*base, {z: 5, y: 6}]\n"
        "three: {<<: [{x: 7}, *base]}\n"
    )
    assert problems == []
    assert data["one"] == {"x": 3, "y": 2}
    assert data["two"] == {"x": 4, "y": 2, "z": 5}
    assert data["three"] == {"x": 7, "y": 2}


def test_a_real_duplicate_beside_a_merge_is_still_reported() -> None:
    _, _, problems = load_yaml("base: &base {x: 1}\none:\n  <<: *base\n  y: 1\n  y: 2\n")
    assert [(p.message, p.line) for p in problems] == [
        ('duplicate key "y" (first defined at line 4)', 5)
    ]


@pytest.mark.parametrize("value", ["1", "[1, 2]", "[{a: 1}, x]"])
def test_merging_what_is_not_a_mapping_is_located(value: str) -> None:
    _, _, problems = load_yaml(f"a: 1\nb:\n  <<: {value}\n")
    assert problems and all(
        p.message == "<< merges a mapping or a list of mappings" and p.line == 3 for p in problems
    )


def test_files_over_the_size_limit_are_refused_before_reading(tmp_path: Path) -> None:
    exact = tmp_path / "exact.yaml"
    exact.write_bytes(b"a: 1\n" + b"#" * (MAX_FILE_BYTES - 6) + b"\n")
    assert read_pipeline_file(exact).startswith("a: 1\n")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(FileProblem, match=r"too large \(1,048,577 bytes; at most 1,048,576"):
        read_pipeline_file(big)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_non_regular_files_are_refused_without_reading(tmp_path: Path, kind: str) -> None:
    if kind == "dev-zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        path = tmp_path / "pipe.yaml"
        os.mkfifo(path)  # no writer: reading would block forever
    else:
        path = tmp_path
    expected = "Is a directory" if kind == "directory" else "not a regular file"
    with pytest.raises(FileProblem, match=f"cannot read pipeline file: {expected}"):
        read_pipeline_file(path)


def test_undecodable_bytes_are_located_by_line_and_character() -> None:
    with pytest.raises(FileProblem) as info:
        decode_pipeline("a: 1\nb: é\xe9".encode("utf-8", "surrogateescape")[:-1] + b"\xff\n")
    assert (info.value.line, info.value.column) == (2, 5)


UNUSUAL_BREAKS = {"cr": "\r", "nel": "\x85", "line-separator": "\u2028", "para-separator": "\u2029"}


@pytest.mark.parametrize("brk", UNUSUAL_BREAKS.values(), ids=list(UNUSUAL_BREAKS))
def test_lines_are_counted_as_an_editor_counts_them(brk: str) -> None:
    # YAML also ends a line at these; grep -n, vim and less do not.
    text = f"# a{brk}# b{brk}\nkey: 1\nbad: !!int x {brk}\n"
    data, marks, problems = load_yaml(text)
    assert data == {"key": 1, "bad": None}
    assert marks.locate(("key",)) == (2, 6)
    assert marks.locate(("bad",), key=True) == (3, 1)
    assert [(p.path, p.line, p.column) for p in problems] == [(("bad",), 3, 6)]

    _, _, problems = load_yaml(f"# a{brk}\nkey: 'open{brk}\n")
    assert [(str(p), p.line, p.column) for p in problems] == [
        (
            "YAML syntax error: found unexpected end of stream"
            " (while scanning a quoted scalar at line 2, column 6)",
            3,
            1,
        )
    ]


@pytest.mark.parametrize("brk", UNUSUAL_BREAKS.values(), ids=list(UNUSUAL_BREAKS))
@pytest.mark.parametrize("ending", ["", "\n"], ids=["no-final-break", "final-break"])
def test_the_end_of_the_stream_is_on_the_editors_lines(brk: str, ending: str) -> None:
    # libyaml may put the end of a stream that lacks a final break on a line
    # of its own past the text: that is the line after the editor's last one.
    def location(text: str) -> tuple[int | None, int | None]:
        _, _, problems = load_yaml(text)
        (problem,) = problems
        return problem.line, problem.column

    end_of_line_2 = (2, 15) if not ending else (3, 1)
    assert location(f"a: 1\nkey: 'open x{brk}y{ending}") == end_of_line_2
    assert location(f"a: 1\nb: x{brk}c{ending}") == (3, 1)
