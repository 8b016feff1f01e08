"""YAML -> validated model -> resolved graph, reporting every problem at once."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path as FsPath
from typing import Any

from pydantic import BaseModel, ValidationError

from composer.discovery import Registry, call_plugin, discover
from composer.errors import PipelineInvalid, Problem, Reporter, did_you_mean, one_of
from composer.loader import (
    MAX_DEPTH,
    MAX_NUMBER_CHARS,
    MAX_VALUES,
    FileProblem,
    Marks,
    load_yaml,
    read_pipeline_file,
)
from composer.pipeline import (
    KV_ROLES,
    LOADING_ROLES,
    SAVING_ROLES,
    KVRole,
    Pipeline,
    ResolvedNode,
    ResolvedPipeline,
    kv_role_named,
    sides_of,
)
from composer.validation.graph import check_graph, dependency_order
from composer.validation.pd import check_pd, node_sides

Path = tuple[str | int, ...]


def load_pipeline(
    source: str | os.PathLike[str] | Mapping[str, Any] | BaseModel,
    *,
    registry: Registry | None = None,
    env: Mapping[str, str] | None = None,
    kv_role: str | None = None,
) -> ResolvedPipeline:
    """Load and fully validate a pipeline from a file path, a mapping or a ``Pipeline``.

    ``kv_role``: the P/D side the engine that runs it plays (``producer``,
    ``consumer``, ``both`` or vLLM's ``kv_*`` names), instead of the file's
    ``kv_role``; the pipeline is checked for that side and resolved to the nodes
    that run there (see :mod:`composer.validation.pd`). A name that is no side
    is a ValueError.

    Raises :class:`~composer.errors.PipelineInvalid` listing every problem, and
    :class:`~composer.discovery.PluginLoadError` when a plugin itself fails.
    """
    if isinstance(source, BaseModel):
        return validate_data(
            source.model_dump(exclude_unset=True), registry=registry, kv_role=kv_role
        )
    if isinstance(source, Mapping):
        # The caller's dict itself, not a copy: a cycle back to it must be seen as one.
        data = source if isinstance(source, dict) else dict(source)
        return validate_data(data, registry=registry, kv_role=kv_role)
    side = kv_role_named(kv_role) if kv_role is not None else None
    file = str(FsPath(source))
    try:
        text = read_pipeline_file(source)
    except FileProblem as exc:
        raise PipelineInvalid([Problem((), exc.message, file, exc.line, exc.column)]) from None
    return validate_text(text, file=file, registry=registry, env=env, kv_role=side)


def validate_text(
    text: str,
    *,
    file: str = "<pipeline>",
    registry: Registry | None = None,
    env: Mapping[str, str] | None = None,
    kv_role: str | None = None,
) -> ResolvedPipeline:
    """Validate a pipeline file's text (``kv_role``: as for :func:`load_pipeline`)."""
    side = kv_role_named(kv_role) if kv_role is not None else None
    data, marks, yaml_problems = load_yaml(text, env=env)
    reporter = Reporter(file, marks)
    for p in yaml_problems:
        reporter.problems.append(Problem(p.path, p.message, file, p.line, p.column))
        if p.replaces_value:
            reporter.settled.add(p.path)
    if data is None:
        if not yaml_problems:
            reporter.add((), "the pipeline file is empty")
        reporter.raise_if_any()
    # Keep going after duplicate keys or unset variables: report everything at once.
    return validate_data(data, registry=registry, reporter=reporter, kv_role=side)


def validate_data(
    data: Any,
    *,
    registry: Registry | None = None,
    reporter: Reporter | None = None,
    kv_role: str | None = None,
) -> ResolvedPipeline:
    """Validate pipeline data (``kv_role``: as for :func:`load_pipeline`)."""
    side = kv_role_named(kv_role) if kv_role is not None else None
    registry = registry if registry is not None else discover()
    reporter = reporter or Reporter("<pipeline>", Marks())
    if not isinstance(data, dict):
        reporter.add((), f"a pipeline is a mapping with version and nodes, not {_kind(data)}")
        reporter.raise_if_any()
    # Once, at the entry: everything after (pydantic, the graph, pipeline.source and
    # vLLM's JSON config) may then take the data for plain data.
    _check_data(data, reporter)
    if not reporter.marks.values:
        # Python data: nothing after this would be located, or safe on a cycle.
        reporter.raise_if_any()

    try:
        pipeline: Pipeline | None = Pipeline.model_validate(data)
    except ValidationError as exc:
        pipeline = None
        _report_pydantic(reporter, exc, (), Pipeline)

    raw_nodes = data.get("nodes") if isinstance(data.get("nodes"), dict) else {}
    configs: dict[str, BaseModel] = {}
    for node_id, raw in raw_nodes.items():
        if not isinstance(raw, dict):
            continue
        plugin = raw.get("plugin")
        if not isinstance(plugin, str):
            continue
        if plugin not in registry:
            reporter.add(
                ("nodes", node_id, "plugin"),
                f"{registry.why_unknown(plugin)}; installed: {one_of(registry.names())}",
            )
            continue
        config_model = registry[plugin].config
        raw_config = raw.get("config", {})
        if raw_config is None:
            # `config:` with every option commented out.
            raw_config = {}
        elif not isinstance(raw_config, dict):
            continue  # the Pipeline model has reported it already
        try:
            configs[node_id] = call_plugin(
                plugin, "validating its config", config_model.model_validate, raw_config
            )
        except ValidationError as exc:
            _report_pydantic(reporter, exc, ("nodes", node_id, "config"), config_model)

    check_graph(data, registry, configs, reporter)
    _check_sides(data, registry, side, reporter)
    reporter.raise_if_any()
    assert pipeline is not None
    if side is not None:
        # The side's role is the pipeline's from here on: what the chain, the
        # exported config and the inline copy vLLM re-validates all go by.
        pipeline = pipeline.model_copy(update={"kv_role": side})
    return _resolve(pipeline, registry, configs, data, reporter.file)


def _check_sides(
    data: dict[str, Any], registry: Registry, side: KVRole | None, reporter: Reporter
) -> None:
    """The P/D rules for the engine's side (``side``, else the file's ``kv_role``),
    read from the raw data like the graph checks: reported with every other problem."""
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, dict):
        return
    roles: dict[str, str] = {}
    native: set[str] = set()
    for node_id, node in raw_nodes.items():
        plugin = node.get("plugin") if isinstance(node, dict) else None
        if not isinstance(plugin, str) or plugin not in registry:
            continue
        role = node.get("role")
        roles[node_id] = role if isinstance(role, str) else registry[plugin].default_role
        if plugin == "vllm":
            native.add(node_id)
    kv_role = side or data.get("kv_role", "kv_both")
    if kv_role not in KV_ROLES:
        return  # reported by the Pipeline model
    check_pd(data, kv_role, side is not None, roles, native, reporter)


def _resolve(
    pipeline: Pipeline,
    registry: Registry,
    configs: dict[str, BaseModel],
    data: dict[str, Any],
    file: str,
) -> ResolvedPipeline:
    nodes: dict[str, ResolvedNode] = {}
    engine_sides = set(sides_of(pipeline.kv_role))
    for node_id, node in pipeline.nodes.items():
        sides = node_sides(data["nodes"][node_id])
        # A node of the other side only is left out, as a disabled one is.
        if not node.enabled or not engine_sides & set(sides):
            continue
        ptype = registry[node.plugin]
        nodes[node_id] = ResolvedNode(
            id=node_id,
            plugin=ptype,
            config=configs[node_id],
            role=node.role or ptype.default_role,
            on_error=node.on_error,
            needs=tuple(n for n in node.needs),
            sides=sides,
            capabilities=call_plugin(
                ptype.name, "resolving capabilities", ptype.resolve_capabilities, configs[node_id]
            ),
        )
    ordered = dependency_order({k: list(v.needs) for k, v in nodes.items()})
    load_order = (
        tuple(n for n in pipeline.load_order if n in nodes)
        if pipeline.load_order is not None
        else tuple(n for n, v in nodes.items() if v.role in LOADING_ROLES)
    )
    save_to = (
        tuple(n for n in pipeline.save_to if n in nodes)
        if pipeline.save_to is not None
        else tuple(n for n, v in nodes.items() if v.role in SAVING_ROLES)
    )
    hma = pipeline.hma == "on" or (
        pipeline.hma == "auto" and all(n.allows_hma for n in nodes.values())
    )
    return ResolvedPipeline(
        nodes=tuple(nodes[n] for n in ordered),
        load_order=load_order,
        save_to=save_to,
        load_policy=pipeline.load_policy,
        kv_role=pipeline.kv_role,
        hma=hma,
        time_layer_hooks=pipeline.time_layer_hooks,
        time_step_hooks=pipeline.time_step_hooks,
        trace=pipeline.trace,
        annotate_outputs=pipeline.annotate_outputs,
        source=pipeline.model_dump(mode="json", exclude_defaults=True) | {"version": 1},
        file=file,
    )


def _check_data(data: dict[str, Any], reporter: Reporter) -> None:
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
        return _show(value)
    return f"an object of type {type(value).__qualname__}"


# --------------------------------------------------------------------------- #
# pydantic errors -> our messages
# --------------------------------------------------------------------------- #


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


def _report_pydantic(
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
            reporter.add(path, f"pipeline format version {_show(got)} is not supported; expected 1")
        elif kind in ("literal_error", "enum"):
            expected = (err.get("ctx") or {}).get("expected", "")
            listed = str(expected).replace(" or ", ",").split(",")
            choices = [c.strip().strip("'\"") for c in listed]
            reporter.add(
                path,
                f"{_show(got)} is not allowed{did_you_mean(str(got), choices)}; "
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
            reporter.add(path, f"expected {_EXPECTED[kind]}, got {_show(got)}")
        else:
            msg = err["msg"]
            msg = msg[:1].lower() + msg[1:]
            if "input" in err:
                msg += f" (got {_show(got)})"
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


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def _show(value: Any) -> str:
    # Double quotes, like every other name in our messages; YAML's null as null.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
