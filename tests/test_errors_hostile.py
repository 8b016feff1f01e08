"""Hostile input at every stage: strict values (ports, the format version,
infinities and NaN), user text escaped so it cannot forge or restyle problem
lines, and ``needs`` chains thousands of nodes long (no recursion, one problem
for a cycle, at most twenty names listed).

Python data passed to ``load_pipeline`` is in test_errors_python_data.py;
failing plugins in test_errors_plugin_failures.py.
"""

from __future__ import annotations

import re

import pytest
from pipeline_checks import Check, Valid

from composer.errors import escape

# --------------------------------------------------------------------------- #
# strict values and escaped output
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


# --------------------------------------------------------------------------- #
# needs chains thousands of nodes long
# --------------------------------------------------------------------------- #


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
