"""``kvc graph`` and ``kvc plugins``: draw a pipeline (text, Mermaid or JSON) and
list the installed plugin types with their config options, and the cache policies
with theirs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from pydantic import ByteSize
from pydantic_core import to_jsonable_python

from composer.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    disabled_nodes,
    dump,
    load,
    model_lines,
    plugin_label,
    predict_model,
    print_problems,
    runs_as,
)
from composer.discovery import BrokenPolicy, Registry, discover
from composer.errors import escape
from composer.loader import file_marks
from composer.model.kv_groups import group_rows
from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.plugin_types import Capabilities, PluginType, model_fields
from composer.policy import KINDS, CachePolicy
from composer.validation.model_check import ModelCheck, check_model
from composer.validation.pd import is_pd, sides_table
from composer.validation.policies import node_policies, policies_label


def node_tiers(node: ResolvedNode) -> list[str]:
    """The storage tiers behind a node, if its config lists them (a ``tiers()`` method)."""
    tiers = getattr(node.config, "tiers", None)
    return [str(t) for t in tiers()] if callable(tiers) else []


def cmd_graph(args: argparse.Namespace) -> int:
    registry = discover()
    pipeline = load(args.file, registry, args.kv_role)
    model = predict_model(args)
    check = (
        check_model(pipeline, model, marks=file_marks(args.file)) if model is not None else None
    )
    if args.json:
        data = _graph_data(pipeline, registry)
        if check is not None:
            data["model"] = _model_data(check)
        print(dump(data))
    elif args.format == "mermaid":
        print(_mermaid(pipeline, registry))
    else:
        text = _graph_text(pipeline, registry, check)
        print("\n".join([*model_lines(model), "", text]) if model is not None else text)
    if check is not None and check.problems:
        print_problems(check.problems, sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _model_data(check: ModelCheck) -> dict[str, Any]:
    return {
        "name": check.model.name,
        "architecture": check.model.architecture,
        "groups": [asdict(g) for g in check.model.groups],
        "hma_off": check.hma_off or None,
        "runs": [asdict(g) for g in check.runs.groups],
        "serves": check.serves,
        "refused": {str(p.path[-1]): p.message for p in check.problems if len(p.path) == 2},
        "notes": list(check.notes),
    }


def _graph_data(p: ResolvedPipeline, registry: Registry) -> dict[str, Any]:
    return {
        "file": p.file,
        "kv_role": p.kv_role,
        "hma": p.hma,
        "runs_as": runs_as(p),
        "nodes": [
            {
                "id": n.id,
                "plugin": n.plugin.name,
                "connector": getattr(n.config, "connector", None)
                if n.plugin.name == "vllm"
                else None,
                "role": n.role,
                "needs": list(n.needs),
                "on_error": n.on_error,
                "tiers": node_tiers(n),
                # The cache policies it runs: kind, config key, name, package, options.
                "policies": [asdict(policy) for policy in node_policies(n.config, registry)],
                # What it does on each P/D side ("" where it does not run).
                "sides": sides_table(p)[n.id],
            }
            for n in p.nodes
        ],
        "disabled": disabled_nodes(p),
        "load_order": list(p.load_order),
        "load_policy": p.load_policy,
        "save_to": list(p.save_to),
    }


def _graph_text(
    p: ResolvedPipeline, registry: Registry, check: ModelCheck | None = None
) -> str:
    labels = {n.id: escape(plugin_label(n)) for n in p.nodes}
    id_width = max((len(n.id) for n in p.nodes), default=0)
    plugin_width = max((len(label) for label in labels.values()), default=0)
    lines = [
        f"pipeline {escape(p.file)}",
        f"  kv_role {p.kv_role}, hma {'on' if p.hma else 'off'}, runs as {runs_as(p)}",
        "",
        "nodes (dependency order):",
    ]
    for n in p.nodes:
        row = f"  {n.id:<{id_width}}  {labels[n.id]:<{plugin_width}}  role {n.role}"
        if n.on_error != "fail":
            row += f", on_error {n.on_error}"
        if n.needs:
            row += f", needs {', '.join(n.needs)}"
        lines.append(row)
        tiers = node_tiers(n)
        if tiers:
            lines.append(f"  {'':<{id_width}}  tiers: {' -> '.join(escape(t) for t in tiers)}")
        policies = policies_label(n.config, registry)
        if policies:
            lines.append(escape(f"  {'':<{id_width}}  policies: {policies}"))
        if check is not None:
            served = check.serves.get(n.id, "cannot serve this model (see below)")
            lines.append(escape(f"  {'':<{id_width}}  model: {served}"))
    disabled = disabled_nodes(p)
    if disabled:
        lines.append(f"  disabled: {', '.join(disabled)}")
    lines += [
        "",
        f"load order ({p.load_policy}): {' -> '.join(p.load_order) or '(none)'}",
        f"save to: {', '.join(p.save_to) or '(none)'}",
    ]
    if is_pd(p):
        lines += ["", f"P/D sides (this engine: {p.kv_role}):"]
        for node_id, actions in sides_table(p).items():
            for i, (side, action) in enumerate(actions.items()):
                head = node_id if i == 0 else ""
                lines.append(f"  {head:<{id_width}}  {side:<8}  {action or '(not on this side)'}")
    if check is not None:
        lines += [escape(f"note: {note}") for note in check.notes]
        if check.runs is not check.model:
            lines += [escape(f"vLLM runs: {row}") for row in group_rows(check.runs.groups)]
    return "\n".join(lines)


_MERMAID_SAFE = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:()"
)


def mermaid_text(text: str) -> str:
    """Text for inside a quoted Mermaid label: anything but letters, digits and a
    little punctuation becomes an entity code (``#34;``), so a name cannot close
    the label, start a new statement (``click``, ``%%{init}%%``) or carry HTML."""
    return "".join(c if c in _MERMAID_SAFE else f"#{ord(c)};" for c in text)


def _mermaid(p: ResolvedPipeline, registry: Registry) -> str:
    # Mermaid ids are positional: node ids may contain '-', which Mermaid reads as an edge.
    ids = {n.id: f"n{i}" for i, n in enumerate(p.nodes)}
    lines = ["flowchart LR"]
    for n in p.nodes:
        parts = [n.id, plugin_label(n), f"role: {n.role}"]
        parts += [f"{x.kind}: {x.name}" for x in node_policies(n.config, registry)]
        label = "<br/>".join(mermaid_text(part) for part in parts)
        lines.append(f'  {ids[n.id]}["{label}"]')
    for n in p.nodes:
        for dep in n.needs:
            if dep in ids:
                lines.append(f"  {ids[n.id]} -. needs .-> {ids[dep]}")
    if p.load_order:
        lines.append(f'  load(["load: {p.load_policy}"])')
        for i, node_id in enumerate(p.load_order, 1):
            lines.append(f"  load -->|{i}| {ids[node_id]}")
    if p.save_to:
        lines.append('  save(["save"])')
        for node_id in p.save_to:
            lines.append(f"  save --> {ids[node_id]}")
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = discover()
    data = [_plugin_data(t) for t in registry.types.values()]
    policies = _policies_in_order(registry)
    if args.json:
        print(
            dump(
                {
                    "plugin_types": data,
                    "cache_policies": [_policy_data(p) for p in policies],
                    "broken_cache_policies": [asdict(b) for b in registry.broken_policies],
                }
            )
        )
        return EXIT_OK
    for i, (ptype, info) in enumerate(zip(registry.types.values(), data, strict=True)):
        if i:
            print()
        origin = " ".join(x for x in (info["package"], info["version"]) if x) or "unknown package"
        print(escape(f"{info['name']}  ({origin})"))
        if info["description"]:
            print(f"  {escape(info['description'])}")
        print(f"  roles: {', '.join(info['roles'])} (default {info['default_role']})")
        print(f"  runs in: {', '.join(info['processes'])}")
        classes = info["classes"]
        if len(set(classes.values())) == 1:
            print(escape(f"  class: {next(iter(classes.values()))}"))
        else:
            print(escape(f"  classes: {', '.join(f'{k} {v}' for k, v in classes.items())}"))
        caps = info["capabilities"]
        if isinstance(caps, str):
            print(f"  capabilities: {caps}")
        else:
            shown = [k if v is True else f"{k}={_show(v)}" for k, v in caps.items() if v]
            print(f"  capabilities: {', '.join(shown) or '(none)'}")
        fields = ptype.config_fields()
        if not fields:
            print("  config: (no options)")
            continue
        print("  config:")
        _print_fields(fields, "    ")
    _print_policies(policies, registry.broken_policies)
    return EXIT_OK


def _print_fields(fields: dict[str, Any], indent: str) -> None:
    width = max(len(name) for name in fields)
    for name, f in fields.items():
        default = "required" if f["required"] else f"default {_show(f['default'])}"
        desc = f"  {f['description']}" if f["description"] else ""
        print(escape(f"{indent}{name:<{width}}  {f['type']}, {default}{desc}"))


def _policies_in_order(registry: Registry) -> list[CachePolicy]:
    """The installed cache policies, by kind (eviction, admission, retention), then name."""
    return sorted(registry.policies.values(), key=lambda p: (KINDS.index(p.kind), p.name))


def _print_policies(policies: list[CachePolicy], broken: tuple[BrokenPolicy, ...]) -> None:
    """The cache policies a tier's config may name (``eviction: lru``), each with its
    options (set in ``eviction_options``), then the registrations that cannot be used."""
    print()
    print(
        "cache policies (a tier's config names one of each kind, eviction: lru, "
        "and gives its options in eviction_options):"
    )
    name_width = max((len(p.name) for p in policies), default=0)
    kind_width = max(len(kind) for kind in KINDS)
    for p in policies:
        origin = " ".join(x for x in (p.package, p.version) if x) or "unknown package"
        row = f"  {p.name:<{name_width}}  {p.kind:<{kind_width}}  ({origin})"
        print(escape(row + (f"  {p.description}" if p.description else "")))
        if p.options is not None and p.options.model_fields:
            print(f"  {'':<{name_width}}  options:")
            _print_fields(model_fields(p.options), " " * (name_width + 6))
    if broken:
        print()
        print("cache policies that cannot be used (a pipeline naming one is refused):")
        for b in broken:
            print(escape(f"  {b.message()}"))


def _show(value: Any) -> str:
    if isinstance(value, ByteSize):
        return value.human_readable()
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(str(v) for v in sorted(value, key=str)) + "]"
    return json.dumps(to_jsonable_python(value, fallback=str))


def _plugin_data(t: PluginType) -> dict[str, Any]:
    classes = {
        role: ref if isinstance(ref, str) else f"{ref.__module__}:{ref.__qualname__}"
        for role, ref in t.class_refs().items()
    }
    capabilities: Any = (
        t.capabilities.model_dump(mode="json")
        if isinstance(t.capabilities, Capabilities)
        else "depends on the node's config"
    )
    return {
        "name": t.name,
        "package": t.package,
        "version": t.version,
        "description": t.description,
        # The class of each vLLM process the node runs in.
        "classes": classes,
        "roles": sorted(t.roles),
        "default_role": t.default_role,
        "processes": sorted(t.processes),
        "capabilities": capabilities,
        "config": to_jsonable_python(t.config_fields(), fallback=str),
    }


def _policy_data(p: CachePolicy) -> dict[str, Any]:
    return {
        "name": p.name,
        "kind": p.kind,
        "package": p.package,
        "version": p.version,
        "description": p.description,
        "class": f"{p.cls.__module__}:{p.cls.__qualname__}",
        "options": to_jsonable_python(
            model_fields(p.options) if p.options is not None else {}, fallback=str
        ),
    }
