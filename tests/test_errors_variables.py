"""Errors of the variable stage: ``${VAR}`` and ``${VAR:-default}`` expand to
text that typed config fields convert; an unset variable, or text a field
cannot convert, is reported at the value. Also the largest size a field takes.

Test plugin types and the ``problems``/``valid`` checkers come from conftest; a
``typed`` plugin type here has a field of each kind plugins use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest
from pipeline_checks import Check, Valid
from pydantic import BaseModel, ByteSize, ConfigDict

from composer import (
    Int,
    Number,
    PipelineInvalid,
    PluginType,
    PositiveByteSize,
    ResolvedPipeline,
    discover,
    hookimpl,
    validate_text,
)


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
