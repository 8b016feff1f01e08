"""The validation driver: YAML text, a file or data -> a :class:`ResolvedPipeline`,
every problem at once (the checks themselves: :mod:`.data`, :mod:`.pydantic_problems`,
:mod:`.graph`, :mod:`.pd`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path as FsPath
from typing import Any

from pydantic import BaseModel, ValidationError

from composer.discovery import Registry, call_plugin, discover
from composer.errors import PipelineInvalid, Problem, Reporter, one_of
from composer.loader import (
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
from composer.validation.data import check_data
from composer.validation.graph import check_graph, dependency_order
from composer.validation.pd import check_pd, node_sides
from composer.validation.policies import check_policies
from composer.validation.pydantic_problems import kind, report_pydantic

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
        reporter.add((), f"a pipeline is a mapping with version and nodes, not {kind(data)}")
        reporter.raise_if_any()
    # Once, at the entry: everything after (pydantic, the graph, pipeline.source and
    # vLLM's JSON config) may then take the data for plain data.
    check_data(data, reporter)
    if not reporter.marks.values:
        # Python data: nothing after this would be located, or safe on a cycle.
        reporter.raise_if_any()

    try:
        pipeline: Pipeline | None = Pipeline.model_validate(data)
    except ValidationError as exc:
        pipeline = None
        report_pydantic(reporter, exc, (), Pipeline)

    configs = _plugin_configs(data, registry, reporter)
    check_graph(data, registry, configs, reporter)
    check_policies(configs, registry, reporter)
    _check_sides(data, registry, side, reporter)
    reporter.raise_if_any()
    assert pipeline is not None
    if side is not None:
        # The side's role is the pipeline's from here on: what the chain, the
        # exported config and the inline copy vLLM re-validates all go by.
        pipeline = pipeline.model_copy(update={"kv_role": side})
    return _resolve(pipeline, registry, configs, data, reporter.file)


def _plugin_configs(
    data: dict[str, Any], registry: Registry, reporter: Reporter
) -> dict[str, BaseModel]:
    """Each node's config, validated by its plugin's model (problems reported)."""
    nodes = data.get("nodes")
    raw_nodes: dict[str, Any] = nodes if isinstance(nodes, dict) else {}
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
            report_pydantic(reporter, exc, ("nodes", node_id, "config"), config_model)

    return configs


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


