"""Errors of ``load_pipeline`` given Python data instead of a file: cycles,
deep or huge data, values that are not data (objects, sets, bytes, NaN, huge
integers, non-string keys) in a mapping or in a ``Pipeline`` model, each a
PipelineInvalid at its dotted path; plain data of every kind is kept.

The ``registry`` of test plugin types comes from conftest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pipeline_checks import Valid

from composer import Node, Pipeline, PipelineInvalid, Registry, load_pipeline


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
