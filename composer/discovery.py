"""Finding plugin types: built-ins plus every ``kv_composer`` entry point allowed to load."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from types import ModuleType

import pluggy

from composer import builtin
from composer.hookspecs import PROJECT, DiscoverySpec
from composer.plugin_types import PluginType

ENTRY_POINT_GROUP = "kv_composer"
ALLOW_ENV = "KV_COMPOSER_PLUGINS"
DENY_ENV = "KV_COMPOSER_DISABLE_PLUGINS"
#: Extra modules (import paths) implementing ``register_plugin_types``, e.g. while
#: developing a plugin that is not installed, or test plugins in vLLM's processes.
MODULES_ENV = "KV_COMPOSER_PLUGIN_MODULES"


class PluginConflict(RuntimeError):
    pass


class PluginLoadError(RuntimeError):
    """A plugin package failed to import or to register its types."""


@dataclass(frozen=True)
class Registry:
    """The plugin types available to a pipeline, by name."""

    types: Mapping[str, PluginType]

    def __getitem__(self, name: str) -> PluginType:
        return self.types[name]

    def __contains__(self, name: object) -> bool:
        return name in self.types

    def names(self) -> list[str]:
        return sorted(self.types)


def _split(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def discover(
    *,
    allow: Iterable[str] | None = None,
    deny: Iterable[str] = (),
    extra: Iterable[ModuleType | object] = (),
    entry_points: bool = True,
) -> Registry:
    """Collect plugin types.

    ``allow`` / ``deny`` name entry points or distributions; when not given they
    come from ``$KV_COMPOSER_PLUGINS`` / ``$KV_COMPOSER_DISABLE_PLUGINS``
    (comma-separated), so a deployment controls what loads. ``extra`` registers
    modules or objects implementing ``register_plugin_types`` directly (tests,
    Python composition).
    """
    allowed = set(allow) if allow is not None else _split(os.environ.get(ALLOW_ENV))
    denied = set(deny) | (_split(os.environ.get(DENY_ENV)) or set())

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(DiscoverySpec)
    sources: dict[str, tuple[str, str]] = {}
    pm.register(builtin, name="builtin")
    sources["builtin"] = ("kv-composer", _version("kv-composer"))
    if entry_points:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else ""
            names = {ep.name, dist}
            if names & denied or (allowed is not None and not names & allowed):
                continue
            if pm.has_plugin(ep.name):
                continue
            try:
                module = ep.load()
            except Exception as exc:
                raise PluginLoadError(
                    f'plugin entry point "{ep.name}" ({ep.value}, from {dist or "unknown"}) '
                    f"failed to import: {type(exc).__name__}: {exc}; disable it with "
                    f"{DENY_ENV}={ep.name}"
                ) from exc
            pm.register(module, name=ep.name)
            sources[ep.name] = (dist, ep.dist.version if ep.dist else "")
    modules = []
    for name in sorted(_split(os.environ.get(MODULES_ENV)) or ()):
        try:
            modules.append(importlib.import_module(name))
        except Exception as exc:
            raise PluginLoadError(
                f'plugin module "{name}" (from {MODULES_ENV}) failed to import: '
                f"{type(exc).__name__}: {exc}"
            ) from exc
    for i, obj in enumerate([*modules, *extra]):
        name = getattr(obj, "__name__", f"extra-{i}")
        pm.register(obj, name=name)
        sources[name] = ("", "")
    pm.check_pending()

    types: dict[str, PluginType] = {}
    for impl in pm.hook.register_plugin_types.get_hookimpls():
        package, version = sources.get(impl.plugin_name, ("", ""))

        def register(ptype: PluginType, _pkg: str = package, _ver: str = version) -> None:
            if ptype.name in types:
                raise PluginConflict(
                    f'plugin type "{ptype.name}" is registered twice '
                    f"({types[ptype.name].package or 'unknown'} and {_pkg or 'unknown'})"
                )
            types[ptype.name] = replace(ptype, package=_pkg, version=_ver)

        try:
            impl.function(register=register)
        except PluginConflict:
            raise
        except Exception as exc:
            raise PluginLoadError(
                f'plugin "{impl.plugin_name}" failed in register_plugin_types: '
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return Registry(dict(sorted(types.items())))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""
