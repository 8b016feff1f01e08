"""pydantic's validation errors as located problems: the dotted key, what was given,
what was expected (with did-you-mean for unknown keys)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from composer.errors import Reporter, did_you_mean, one_of

Path = tuple[str | int, ...]


_EXPECTED = {
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
    "set_type": "a list",
    "frozen_set_type": "a list",
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "byte_size": "a size such as 8GiB, 512MB or a number of bytes",
    "byte_size_unit": "a size unit such as B, KB, MB, GB, KiB, MiB or GiB",
    "byte_size_too_large": "a size of at most 1EiB (no machine holds more)",
}


def report_pydantic(
    reporter: Reporter, exc: ValidationError, prefix: Path, model: type[BaseModel]
) -> None:
    for err in exc.errors(include_url=False):
        loc: Path = tuple(err["loc"])
        kind = err["type"]
        path = prefix + loc
        got = err.get("input")
        if kind == "extra_forbidden":
            fields = _fields_at(model, loc[:-1])
            hint = did_you_mean(str(loc[-1]), fields) if fields else ""
            reporter.add(
                path,
                f'unknown key "{loc[-1]}"{hint}; valid keys: {one_of(fields)}',
                key=True,
            )
        elif kind == "missing":
            # At the key that holds the incomplete mapping, which is what one edits.
            reporter.add(path[:-1], f'missing required key "{loc[-1]}"', key=True)
        elif path == ("version",):
            reporter.add(path, f"pipeline format version {show(got)} is not supported; expected 1")
        elif kind in ("literal_error", "enum"):
            expected = (err.get("ctx") or {}).get("expected", "")
            listed = str(expected).replace(" or ", ",").split(",")
            choices = [c.strip().strip("'\"") for c in listed]
            reporter.add(
                path,
                f"{show(got)} is not allowed{did_you_mean(str(got), choices)}; "
                f"expected one of {one_of(c for c in choices if c)}",
            )
        elif kind == "string_pattern_mismatch" and loc and loc[-1] == "[key]":
            reporter.add(
                path[:-1],
                "node ids start with a letter and use letters, digits, '-' and '_' only",
                key=True,
            )
        elif kind == "too_short" and path == ("nodes",):
            reporter.add(path, "a pipeline needs at least one node")
        elif kind in _EXPECTED:
            reporter.add(path, f"expected {_EXPECTED[kind]}, got {show(got)}")
        else:
            msg = err["msg"]
            msg = msg[:1].lower() + msg[1:]
            if "input" in err:
                msg += f" (got {show(got)})"
            reporter.add(path, msg)


def _fields_at(model: type[BaseModel], loc: Path) -> list[str]:
    """Field names of the (nested) model at ``loc``, for did-you-mean hints."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(current, type) and issubclass(current, BaseModel):
            f = current.model_fields.get(str(part))
            if f is None:
                # A dict[str, Model] level: the key is an id, step into the value type.
                continue
            current = _model_in(f.annotation)
        else:
            current = _model_in(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or name for name, f in current.model_fields.items()]
    return []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def show(value: Any) -> str:
    # Double quotes, like every other name in our messages; YAML's null as null.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
