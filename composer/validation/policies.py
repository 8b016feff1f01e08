"""Cache policies in a pipeline: each policy a node config names (``eviction: lfu``, a
field marked :class:`~composer.policy.PolicyName`) is an installed, usable policy of
that kind, and the options beside it (``eviction_options``) are what that policy's
options model accepts, every problem located in the file.

Also what the CLI shows of them: the policies a node runs (:func:`node_policies`,
:func:`policies_label`, for ``kvc graph`` and reports) and the installed names and
options in the pipeline's JSON Schema (:func:`add_policies_to_schema`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from composer.discovery import Registry, UnknownPolicy, call_plugin
from composer.errors import Reporter, did_you_mean, one_of
from composer.policy import KINDS, CachePolicy, PolicyName, policy_fields
from composer.validation.pydantic_problems import report_pydantic, show


def check_policies(
    configs: Mapping[str, BaseModel], registry: Registry, reporter: Reporter
) -> None:
    """Each node config's policy names and their options (``configs``: the node configs
    their plugins' models accepted, by node id)."""
    for node_id, config in configs.items():
        model_fields = type(config).model_fields
        for name_field, kind in policy_fields(type(config)).items():
            name = getattr(config, name_field)
            if not isinstance(name, str):
                continue
            try:
                policy = registry.policy(kind, name)
            except UnknownPolicy as exc:
                reporter.add(("nodes", node_id, "config", name_field), str(exc))
                continue
            options_field = PolicyName.options_field(name_field)
            given = getattr(config, options_field, None) if options_field in model_fields else None
            path = ("nodes", node_id, "config", options_field)
            check_options(policy, given if isinstance(given, Mapping) else {}, path, reporter)


def check_options(
    policy: CachePolicy, given: Mapping[str, Any], path: tuple[str, ...], reporter: Reporter
) -> None:
    """``given`` (a node's ``eviction_options``) against ``policy``'s options model,
    problems reported at ``path`` (the options field) and below."""
    model = policy.options
    what = f'{policy.kind} policy "{policy.name}"'
    if model is None:
        for key in given:
            message = f"unknown key {show(key)}: the {what} takes no options"
            reporter.add((*path, key), message, key=True)
        return
    keys = [f.alias or name for name, f in model.model_fields.items()]
    # Refused whatever the model's own `extra` says (pydantic ignores unknown keys by
    # default): a misspelt option would silently keep its default. A model that asks
    # for extra keys (extra="allow") gets them.
    if model.model_config.get("extra") != "allow":
        unknown = [key for key in given if key not in keys]
        for key in unknown:
            reporter.add(
                (*path, key),
                f"unknown key {show(key)}{did_you_mean(str(key), keys)}; the {what} takes: "
                f"{one_of(keys)}",
                key=True,
            )
        given = {k: v for k, v in given.items() if k not in unknown}
    try:
        call_plugin(
            policy.package or policy.name,
            f"validating the options of cache policy {show(policy.name)}",
            model.model_validate,
            dict(given),
        )
    except ValidationError as exc:
        report_pydantic(reporter, exc, path, model)


@dataclass(frozen=True)
class NodePolicy:
    """A cache policy a node runs, as ``kvc graph`` shows it."""

    kind: str
    #: The config field that names it (``eviction``).
    config_key: str
    name: str
    #: The distribution that provides it ("" when not installed here).
    package: str
    #: Its options, validated, defaults included (JSON data; {}: it takes none).
    options: dict[str, Any] = field(default_factory=dict)


def node_policies(config: BaseModel, registry: Registry) -> list[NodePolicy]:
    """The cache policies a node config names, eviction first, then admission, retention
    (none for a plugin whose config names no policy)."""
    out = []
    fields = sorted(policy_fields(type(config)).items(), key=lambda fk: KINDS.index(fk[1]))
    for name_field, kind in fields:
        name = str(getattr(config, name_field))
        raw = getattr(config, PolicyName.options_field(name_field), None) or {}
        policy = registry.policies.get(name)
        options: dict[str, Any] = dict(raw) if isinstance(raw, Mapping) else {}
        if policy is not None and policy.options is not None:
            # (Not validated for this policy, e.g. a sweep's value: shown as given.)
            with contextlib.suppress(ValidationError):
                options = policy.options.model_validate(options).model_dump(mode="json")
        out.append(NodePolicy(kind, name_field, name, policy.package if policy else "", options))
    return out


def policies_label(config: BaseModel, registry: Registry) -> str:
    """One line for a node's policies: ``eviction lfu (max_count=8), admission threshold,
    retention request`` ("" when its config names none). For reports that list nodes
    (``kvc graph``; a simulation's per-node table)."""
    parts = []
    for p in node_policies(config, registry):
        options = ", ".join(f"{k}={show(v)}" for k, v in p.options.items())
        parts.append(f"{p.kind} {p.name}" + (f" ({options})" if options else ""))
    return ", ".join(parts)


def add_policies_to_schema(schema: dict[str, Any], registry: Registry) -> None:
    """Give the pipeline's JSON Schema (``kvc schema``) the installed cache policies: each
    policy field of a plugin's config gets the names of its kind as its allowed values,
    and its options field (``eviction_options``) the options model of the policy named
    (``if eviction is "lfu" then eviction_options is LfuOptions``; a policy without
    options: an empty mapping)."""
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    for ptype in registry:
        fields = policy_fields(ptype.config)
        config_def = _config_def(defs, ptype.name)
        if not fields or config_def is None:
            continue
        properties = config_def.get("properties", {})
        conditions: list[dict[str, Any]] = []
        for name_field, kind in fields.items():
            policies = [p for p in registry.policies.values() if p.kind == kind]
            if name_field not in properties:
                continue
            prop = properties[name_field]
            prop["enum"] = [p.name for p in policies]
            installed = "; ".join(
                f'"{p.name}" ({p.package or "unknown package"}): {p.description}'.rstrip(": ")
                for p in policies
            )
            prop["description"] = f"{prop.get('description', '')} Installed: {installed}.".strip()
            options_field = PolicyName.options_field(name_field)
            if options_field not in properties:
                continue
            default = ptype.config.model_fields[name_field].default
            for p in policies:
                when: dict[str, Any] = {"properties": {name_field: {"const": p.name}}}
                if p.name != default:  # (the default is the policy when the field is left out)
                    when["required"] = [name_field]
                then: dict[str, Any] = {
                    "properties": {
                        options_field: (
                            {"maxProperties": 0} if p.options is None else _options_ref(defs, p)
                        )
                    }
                }
                if p.options is not None and any(
                    f.is_required() for f in p.options.model_fields.values()
                ):
                    then["required"] = [options_field]  # (leaving them out leaves a value out)
                conditions.append({"if": when, "then": then})
        if conditions:
            config_def.setdefault("allOf", []).extend(conditions)


def _config_def(defs: dict[str, Any], plugin: str) -> dict[str, Any] | None:
    """The schema of ``plugin``'s config model, through its node variant
    (:func:`composer.pipeline.typed_pipeline_model` names it ``Node_<plugin>``)."""
    node = defs.get(f"Node_{plugin.replace('-', '_')}", {})
    ref = node.get("properties", {}).get("config", {}).get("$ref", "")
    found = defs.get(ref.rpartition("/")[2]) if ref.startswith("#/$defs/") else None
    return found if isinstance(found, dict) else None


def _options_ref(defs: dict[str, Any], policy: CachePolicy) -> dict[str, str]:
    """``policy``'s options model added to ``defs`` (its own nested models under its key,
    so that two packages' models of one name never collide); a ``$ref`` to it."""
    assert policy.options is not None
    key = "PolicyOptions_" + re.sub(r"[^A-Za-z0-9_]", "_", f"{policy.kind}_{policy.name}")
    sub = policy.options.model_json_schema(ref_template=f"#/$defs/{key}__{{model}}")
    for name, nested in sub.pop("$defs", {}).items():
        defs[f"{key}__{name}"] = nested
    defs[key] = sub
    return {"$ref": f"#/$defs/{key}"}

