"""What data a pipeline may hold: plain YAML-like data, bounded (checked once, at the
entry, so that everything after may take it for plain data)."""

from __future__ import annotations

import math
from typing import Any

from composer.errors import Reporter
from composer.loader import (
    MAX_DEPTH,
    MAX_NUMBER_CHARS,
    MAX_VALUES,
)
from composer.validation.pydantic_problems import show

Path = tuple[str | int, ...]


def check_data(data: dict[str, Any], reporter: Reporter) -> None:
    """Refuse what is not plain data, cycles, nesting past :data:`MAX_DEPTH` and more
    than :data:`MAX_VALUES` values.

    A pipeline is JSON-like data: mappings with string keys, lists, strings, finite
    numbers, true/false and null. It travels to vLLM as JSON, where a set, bytes or an
    object would be changed or fail in a serializer, and NaN would become null; so
    anything else is refused here, at its dotted key, before any of that. A file's
    data is bounded by the loader and can only hold .nan or .inf; Python data can
    hold anything. Iterative, so that neither this walk nor a cycle reaches a
    RecursionError.
    """
    count = 0
    on_path: set[int] = set()
    # (path, value, entering): a container is left after all its children.
    stack: list[tuple[Path, Any, bool]] = [((), data, True)]
    while stack:
        path, value, entering = stack.pop()
        if not isinstance(value, dict | list | tuple):
            count += 1
            problem = _not_data(value)
            if problem:
                reporter.add(path, problem)
                reporter.settled.add(path)  # its own type check would only repeat it
            continue
        if not entering:
            on_path.discard(id(value))
            continue
        count += 1
        if id(value) in on_path:
            reporter.add(path, "refers to a mapping or list that contains it (a cycle)")
            continue
        if len(path) >= MAX_DEPTH:
            reporter.add(path, f"nested deeper than {MAX_DEPTH} levels")
            continue
        if count > MAX_VALUES:
            reporter.add((), f"more than {MAX_VALUES:,} values")
            return
        on_path.add(id(value))
        stack.append((path, value, False))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(value, dict) and not isinstance(key, str):
                reporter.add(path, f"mapping keys are strings, not {_describe(key)}")
                continue
            stack.append(((*path, key), child, True))


#: Widest integer a pipeline holds, as a file's numbers (:data:`MAX_NUMBER_CHARS`).
_MAX_INT = 10**MAX_NUMBER_CHARS


def _not_data(value: Any) -> str | None:
    """Why a value inside a pipeline is not plain data, or None when it is."""
    if value is None or isinstance(value, str | bool):
        return None
    if isinstance(value, int):
        if abs(value) < _MAX_INT:
            return None
        return (
            f"integer of more than {MAX_NUMBER_CHARS} digits; at most {MAX_NUMBER_CHARS} are read"
        )
    if isinstance(value, float):
        if math.isfinite(value):
            return None
        return f"expected a finite number, got {float(value)!r}"
    return f"expected a mapping, list, string, number, true/false or null, got {_describe(value)}"


def _describe(value: Any) -> str:
    """A key or value for a message: a plain scalar as written, anything else by its
    type (an object's own repr may raise, or run for ever)."""
    if (
        value is None
        or type(value) in (bool, float)
        or (type(value) is int and abs(value) < _MAX_INT)
    ):
        return show(value)
    return f"an object of type {type(value).__qualname__}"


# --------------------------------------------------------------------------- #
# pydantic errors -> our messages
# --------------------------------------------------------------------------- #


