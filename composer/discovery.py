"""Finding plugin types: built-ins plus every ``kv_composer`` entry point allowed to load."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import pluggy
from pydantic import BaseModel, ValidationError

from composer import builtin
from composer.errors import did_you_mean
from composer.hookspecs import PROJECT, DiscoverySpec
from composer.plugin_types import PluginType
from composer.policy import KINDS, CachePolicy

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


class UnknownPolicy(LookupError):
    """A node config names a cache policy no installed package provides, or one that
    cannot be used (:class:`BrokenPolicy`)."""


@dataclass(frozen=True)
class BrokenPolicy:
    """A cache policy registration that cannot be used, and why. Discovery keeps going:
    every command, and every pipeline that does not name it, runs; a pipeline that
    names it is refused, located, with :attr:`way_out`."""

    #: The name it was registered under ("": none, e.g. its package's hook raised).
    name: str
    kind: str
    problem: str
    #: Who registered it: ``kvc-lfu 0.1.0``, ``module "lfu" (KV_COMPOSER_PLUGIN_MODULES)``.
    origin: str
    #: The distribution ("" for a module or a Python object), for ``kvc plugins --json``.
    package: str
    #: What the user can do about it without editing the package ("" when nothing).
    way_out: str

    def message(self) -> str:
        what = f"{self.kind} policy" if self.kind in KINDS else "cache policy"
        named = f'{what} "{self.name}"' if self.name else "a cache policy"
        text = f"{named} from {self.origin} cannot be used: {self.problem}"
        return text + (f"; {self.way_out}" if self.way_out else "")


class PluginFailed(PluginLoadError):
    """A plugin's own code (config validator, capabilities, check) raised: a plugin bug."""


#: What a plugin's code may raise that is still the plugin's failure, not ours to
#: crash on: ``sys.exit()`` inside an import or a hook included (it would end
#: `kvc validate` with the plugin's exit code, e.g. 0 for an invalid file).
PLUGIN_FAILURES = (Exception, SystemExit)

_T = TypeVar("_T")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def call_plugin(plugin: str, what: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Run a plugin's code; anything it raises (but a pydantic ValidationError, which is
    about the user's input) becomes :class:`PluginFailed`."""
    try:
        return fn(*args)
    except ValidationError:
        raise
    except PLUGIN_FAILURES as exc:
        raise PluginFailed(f'plugin "{plugin}" failed while {what}: {_describe(exc)}') from exc


@dataclass(frozen=True)
class Registry:
    """The plugin types available to a pipeline: ``registry["offload-cpu"]``, ``"x" in
    registry``, and ``for ptype in registry`` (in name order)."""

    types: Mapping[str, PluginType]
    #: Installed entry points not loaded, and why (the variable that switched them off).
    switched_off: Mapping[str, str] = field(default_factory=dict)
    #: The cache policies node configs may name (``eviction: lru``), by name.
    policies: Mapping[str, CachePolicy] = field(default_factory=dict)
    #: Cache policy registrations that cannot be used (a pipeline naming one is refused).
    broken_policies: tuple[BrokenPolicy, ...] = ()

    def __getitem__(self, name: str) -> PluginType:
        return self.types[name]

    def __contains__(self, name: object) -> bool:
        return name in self.types

    def __iter__(self) -> Iterator[PluginType]:
        return iter(self.types[name] for name in self.names())

    def __len__(self) -> int:
        return len(self.types)

    def names(self) -> list[str]:
        return sorted(self.types)

    def policy(self, kind: str, name: str) -> CachePolicy:
        """The ``kind`` policy called ``name``; :class:`UnknownPolicy` says what exists (and,
        for a registration that cannot be used, why, who made it and the way out)."""
        found = self.policies.get(name)
        if found is not None and found.kind == kind:
            return found
        names = sorted(p.name for p in self.policies.values() if p.kind == kind)
        listed = f"{kind} policies: " + (", ".join(f'"{n}"' for n in names) or "(none)")
        broken = next((b for b in self.broken_policies if b.name == name), None)
        if broken is not None:
            raise UnknownPolicy(f"{broken.message()}; {listed}")
        what = (
            f'"{name}" is {_a(found.kind)} policy' if found else f'unknown {kind} policy "{name}"'
        )
        text = f"{what}{did_you_mean(name, names)}; {listed}"
        nameless = [b for b in self.broken_policies if not b.name]
        if nameless and not found:  # what the name may have been meant to find
            text += "; and " + "; ".join(b.message() for b in nameless)
        raise UnknownPolicy(text)

    def why_unknown(self, name: str) -> str:
        """What to tell a user who names plugin ``name``, which is not here."""
        if name in self.switched_off:
            return (
                f'plugin "{name}" is installed but switched off by {self.switched_off[name]}'
            )
        close = did_you_mean(name, self.names())
        text = f'unknown plugin "{name}"{close}'
        if self.switched_off and not close:  # not a typo: maybe a package switched off
            off = ", ".join(f'"{ep}" ({why})' for ep, why in sorted(self.switched_off.items()))
            text += f"; plugin packages switched off, whose types are not known: {off}"
        return text


class _Source(NamedTuple):
    """Where a registered plugin module came from."""

    package: str
    version: str
    #: "builtin", "entry point", MODULES_ENV (a module it names) or "extra" (Python).
    via: str


def _a(word: str) -> str:
    """``word`` with its indefinite article: "an eviction", "a retention"."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


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
    sources: dict[str, _Source] = {}
    pm.register(builtin, name="builtin")
    sources["builtin"] = _Source("kv-composer", _version("kv-composer"), "builtin")
    switched_off: dict[str, str] = {}
    if entry_points:
        switched_off = _register_entry_points(pm, sources, allowed, denied)
    from_env = _env_modules()
    for i, obj in enumerate([*from_env, *extra]):
        name = getattr(obj, "__name__", f"extra-{i}")
        pm.register(obj, name=name)
        sources[name] = _Source("", "", MODULES_ENV if i < len(from_env) else "extra")
    pm.check_pending()
    policies, broken = _collect_policies(pm, sources)
    return replace(
        _collect_types(pm, sources),
        switched_off=switched_off,
        policies=policies,
        broken_policies=broken,
    )


def find_policy(kind: str, name: str) -> type:
    """The class of the installed ``kind`` cache policy ``name``, for a tier building its
    policies (in a vLLM process, in the simulator): :func:`discover`'s, found once per
    setting of the variables that choose the plugins."""
    env = tuple(os.environ.get(v) for v in (ALLOW_ENV, DENY_ENV, MODULES_ENV))
    return _installed(env).policy(kind, name).cls


@functools.lru_cache(maxsize=4)
def _installed(env: tuple[str | None, ...]) -> Registry:
    return discover()


def _register_entry_points(
    pm: pluggy.PluginManager,
    sources: dict[str, _Source],
    allowed: set[str] | None,
    denied: set[str],
) -> dict[str, str]:
    """Load the allowed entry points; returns the others' names, each with why not."""
    skipped: dict[str, str] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else ""
        names = {ep.name, dist}
        if names & denied:
            env_denied = names & (_split(os.environ.get(DENY_ENV)) or set())
            skipped[ep.name] = f"{DENY_ENV}={os.environ[DENY_ENV]}" if env_denied else "deny="
            continue
        if allowed is not None and not names & allowed:
            skipped[ep.name] = (
                f"{ALLOW_ENV}={os.environ[ALLOW_ENV]} (not listed)"
                if ALLOW_ENV in os.environ
                else "allow="
            )
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            module = ep.load()
        except PLUGIN_FAILURES as exc:
            raise PluginLoadError(
                f'plugin entry point "{ep.name}" ({ep.value}, from {dist or "unknown"}) '
                f"failed to import: {_describe(exc)}; disable it with "
                f"{DENY_ENV}={ep.name}"
            ) from exc
        pm.register(module, name=ep.name)
        sources[ep.name] = _Source(dist, ep.dist.version if ep.dist else "", "entry point")
    return skipped


def _env_modules() -> list[ModuleType]:
    """The modules named in ``$KV_COMPOSER_PLUGIN_MODULES``, imported."""
    modules = []
    for name in sorted(_split(os.environ.get(MODULES_ENV)) or ()):
        try:
            modules.append(importlib.import_module(name))
        except PLUGIN_FAILURES as exc:
            raise PluginLoadError(
                f'plugin module "{name}" (from {MODULES_ENV}) failed to import: '
                f"{_describe(exc)}"
            ) from exc
    return modules


def _collect_types(pm: pluggy.PluginManager, sources: dict[str, _Source]) -> Registry:
    """Every plugin's ``register_plugin_types``, each type checked and named once."""
    types: dict[str, PluginType] = {}
    for impl in pm.hook.register_plugin_types.get_hookimpls():
        package, version, _ = sources.get(impl.plugin_name, _Source("", "", "extra"))

        def register(
            ptype: PluginType, _pkg: str = package, _ver: str = version, _by: str = impl.plugin_name
        ) -> None:
            _check_type(ptype, _by)
            if ptype.name in types:
                raise PluginConflict(
                    f'plugin type "{ptype.name}" is registered twice '
                    f"({types[ptype.name].package or 'unknown'} and {_pkg or 'unknown'})"
                )
            types[ptype.name] = replace(ptype, package=_pkg, version=_ver)

        _run_register(impl, "register_plugin_types", register)
    return Registry(dict(sorted(types.items())))


def _run_register(impl: Any, hook: str, register: Callable[[Any], None]) -> None:
    """A plugin's registration hook: what it raises, but our own refusals, is its failure."""
    try:
        impl.function(register=register)
    except (PluginConflict, PluginLoadError):
        raise
    except PLUGIN_FAILURES as exc:
        raise PluginLoadError(
            f'plugin "{impl.plugin_name}" failed in {hook}: {_describe(exc)}'
        ) from exc


def _collect_policies(
    pm: pluggy.PluginManager, sources: dict[str, _Source]
) -> tuple[dict[str, CachePolicy], tuple[BrokenPolicy, ...]]:
    """Every plugin's ``register_cache_policies``: the usable policies by name, and the
    registrations that are not. A broken one (not a CachePolicy, a class that fails its
    spec, a name registered twice, a hook that raised) is kept aside, not raised: a
    policy runs only in the tiers whose pipeline names it, so only those are refused."""
    registered: list[tuple[object, str]] = []  # (what was registered, by which plugin)
    broken: list[BrokenPolicy] = []
    for impl in pm.hook.register_cache_policies.get_hookimpls():
        by = impl.plugin_name

        def register(policy: object, _by: str = by) -> None:
            registered.append((policy, _by))

        try:
            impl.function(register=register)
        except PLUGIN_FAILURES as exc:
            problem = f"register_cache_policies raised {_describe(exc)}"
            broken.append(_broken("", "", problem, [by], sources))

    by_name: dict[str, list[tuple[object, str]]] = {}
    for policy, by in registered:
        named = isinstance(policy, CachePolicy) and isinstance(policy.name, str)
        name = policy.name if isinstance(policy, CachePolicy) and named else ""
        by_name.setdefault(name, []).append((policy, by))
    policies: dict[str, CachePolicy] = {}
    for name, regs in sorted(by_name.items()):
        if name and len(regs) > 1:
            # Nobody's: which one a tier ran would depend on the order packages load in.
            kind = str(getattr(regs[0][0], "kind", ""))
            problem = f"registered {len(regs)} times"  # (by whom: the origin says)
            broken.append(_broken(name, kind, problem, [by for _, by in regs], sources))
            continue
        for policy, by in regs:
            problems = (
                policy.problems()
                if isinstance(policy, CachePolicy)
                else [f"registered {type(policy).__name__}, not a CachePolicy"]
            )
            if problems:
                kind = str(getattr(policy, "kind", ""))
                broken.append(_broken(name, kind, "; ".join(problems), [by], sources))
            else:
                assert isinstance(policy, CachePolicy)
                source = sources.get(by, _Source("", "", "extra"))
                policies[name] = replace(policy, package=source.package, version=source.version)
    return policies, tuple(broken)


def _origin(by: str, sources: dict[str, _Source]) -> str:
    """Who registered something: ``kvc-lfu 0.1.0``, or the module's name and how it came."""
    source = sources.get(by, _Source("", "", "extra"))
    if source.package:
        return f"{source.package} {source.version}".strip()
    if source.via == MODULES_ENV:
        return f'module "{by}" ({MODULES_ENV})'
    return f'"{by}"'


def _broken(
    name: str, kind: str, problem: str, by: list[str], sources: dict[str, _Source]
) -> BrokenPolicy:
    """A registration that cannot be used (made by the plugins ``by``: two for a name
    registered twice), with what the user can do about it without editing a package."""
    outs = []
    for plugin in by:
        source = sources.get(plugin, _Source("", "", "extra"))
        # (The built-ins cannot be switched off; a Python object is its caller's to drop.)
        if source.via == "entry point":
            target = source.package or plugin
            off = f"switch {target} off with {DENY_ENV}={target}"
            outs.append((f"fix or upgrade {target}", off))
        elif source.via == MODULES_ENV:
            outs.append((f'fix module "{plugin}"', f'take "{plugin}" out of {MODULES_ENV}'))
    if len(by) == 1 and outs:
        way_out = f"{outs[0][0]}, or {outs[0][1]}"
    else:  # a name two registered: one of them has to go
        way_out = " or ".join(off for _, off in outs)
    return BrokenPolicy(
        name=name,
        kind=kind,
        problem=problem,
        origin=" and ".join(_origin(plugin, sources) for plugin in by),
        package=", ".join(sorted({sources[b].package for b in by if b in sources} - {""})),
        way_out=way_out,
    )


def _check_type(ptype: object, by: str) -> None:
    """Refuse a registration that validation could only crash on later."""
    problem = ""
    if not isinstance(ptype, PluginType):
        problem = f"registered {type(ptype).__name__}, not a PluginType"
    elif not isinstance(ptype.name, str) or not ptype.name:
        problem = "a plugin type needs a non-empty string name"
    elif not (isinstance(ptype.config, type) and issubclass(ptype.config, BaseModel)):
        problem = f'plugin type "{ptype.name}": config must be a pydantic model class'
    elif ptype.check is not None and not callable(ptype.check):
        problem = f'plugin type "{ptype.name}": check must be callable'
    elif declared := ptype.problems():
        problem = f'plugin type "{ptype.name}": ' + "; ".join(declared)
    if problem:
        raise PluginLoadError(f'plugin "{by}" failed in register_plugin_types: {problem}')


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""
