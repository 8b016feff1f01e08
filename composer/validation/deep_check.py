"""Checks that need the runtime: node classes and vLLM's connector registry.

``kvc validate --deep`` runs these. At engine start the vLLM adapter checks
the connector names (``classes=False``) and the chain checks the node classes
it creates (pluggy's own checks and :func:`unsupported_hookimpl_options`).
Nothing heavy is imported at module level, so importing this module stays as
light as ``import composer``:

* every node class of every node (per vLLM process) is imported, must
  subclass :class:`composer.plugin.Plugin`, and is registered with a pluggy
  ``PluginManager`` holding :class:`composer.hookspecs.NodeSpec` (then
  ``check_pending()``), so a typo in ``"module:Class"``, a misspelled hook or
  a hook argument the spec lacks is reported before vLLM starts;
* hookimpl options the chain does not honour (:data:`UNHONOURED_OPTIONS`) are
  errors: the chain calls nodes in pipeline order, one call per node;
* each node class's own :meth:`~composer.plugin.Plugin.launch_problems` for
  the node's config (what the installed libraries keep it from doing);
* each cache policy a node config names (``eviction: lfu``) is checked against its
  kind's spec: every method it defines takes the call the tier makes, and none is
  named like a spec method it leaves to the spec's default (``touch`` beside
  ``touched``, which the tier would never call);
* ``vllm`` nodes' connector names are checked against vLLM's real registry.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from collections.abc import Iterable

import pluggy

from composer.builtin import nixl_poll_problem
from composer.discovery import Registry, UnknownPolicy, discover
from composer.errors import Problem, did_you_mean, one_of
from composer.hook_table import HOOKS
from composer.hookspecs import PROJECT, NodeSpec
from composer.loader import Marks
from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.plugin import Plugin
from composer.plugin_types import ClassRef, choose_class, resolve_ref
from composer.policy import misnamed_methods, policy_fields

#: Hookimpl options the chain does not honour: a wrapper never wraps (the chain
#: is no pluggy hook call) and order is pipeline order, not tryfirst/trylast.
UNHONOURED_OPTIONS = ("wrapper", "hookwrapper", "tryfirst", "trylast")
_IMPL_ATTR = PROJECT + "_impl"


def vllm_connector_names() -> frozenset[str]:
    """Names registered in the installed vLLM's ``KVConnectorFactory`` (imports vLLM)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return frozenset(KVConnectorFactory._registry)


def deep_check(
    pipeline: ResolvedPipeline,
    *,
    marks: Marks | None = None,
    registered: Iterable[str] | None = None,
    classes: bool = True,
    registry: Registry | None = None,
) -> list[Problem]:
    """Problems only the runtime can reveal; an empty list when there are none.

    ``marks`` (from :func:`composer.loader.load_yaml`) locates problems in the
    pipeline file; without them problems carry the file name only.
    ``registered`` overrides the connector names read from vLLM; ``classes``
    False skips the node-class and cache policy checks (``registry``: where the
    policies are found; default :func:`~composer.discovery.discover`'s). vLLM is
    imported only when the pipeline has ``vllm`` nodes (an ImportError then means
    vLLM is missing).
    """
    marks = marks or Marks()
    problems = _connector_problems(pipeline, marks, registered)
    if classes:
        for node in pipeline.nodes:
            problems += [
                _located(pipeline, marks, node, message)
                for message in node_class_problems(node)
            ]
        problems += _policy_problems(pipeline, marks, registry or discover())
    return problems


def _policy_problems(
    pipeline: ResolvedPipeline, marks: Marks, registry: Registry
) -> list[Problem]:
    """Each cache policy a node runs, against its kind's spec (its methods' names and
    signatures), located at the config field that names it."""
    problems = []
    for node in pipeline.nodes:
        for field, kind in policy_fields(type(node.config)).items():
            try:
                policy = registry.policy(kind, str(getattr(node.config, field)))
            except UnknownPolicy as exc:  # (validation refused it; a registry of its own may not)
                messages = [str(exc)]
            else:
                # Registration has checked the signatures (a policy that fails them is
                # not usable); asked again here for a registry built otherwise.
                messages = [*policy.problems(), *misnamed_methods(policy.cls, policy.kind)]
            path = ("nodes", node.id, "config", field)
            problems += [_located_at(pipeline, marks, path, m) for m in messages]
    return problems


def sleep_mode_problems(
    pipeline: ResolvedPipeline,
    refusals: Iterable[tuple[ResolvedNode, str]],
    *,
    marks: Marks | None = None,
) -> list[Problem]:
    """One located problem per node that cannot follow vLLM's sleep mode, from
    :func:`composer.vllm.pipeline_source.sleep_mode_refusals` (where a ``vllm``
    node's connector class answers: it needs vLLM)."""
    return [
        _located(
            pipeline,
            marks or Marks(),
            node,
            f'node "{node.id}" cannot follow vLLM\'s sleep mode (--enable-sleep-mode): {why}',
        )
        for node, why in refusals
    ]


def _located(
    pipeline: ResolvedPipeline, marks: Marks, node: ResolvedNode, message: str
) -> Problem:
    return _located_at(pipeline, marks, ("nodes", node.id, "plugin"), message)


def _located_at(
    pipeline: ResolvedPipeline, marks: Marks, path: tuple[str, ...], message: str
) -> Problem:
    line, column = marks.locate(path)
    return Problem(path, message, pipeline.file, line, column)


def _connector_problems(
    pipeline: ResolvedPipeline, marks: Marks, registered: Iterable[str] | None
) -> list[Problem]:
    natives = [n for n in pipeline.nodes if n.plugin.name == "vllm"]
    if not natives:
        return []
    names = frozenset(registered) if registered is not None else vllm_connector_names()
    problems = _nixl_poll_problems(pipeline, marks, natives)
    for node in natives:
        # An out-of-tree connector is loaded from its module path, not looked up by name.
        if getattr(node.config, "module_path", None):
            continue
        connector = str(getattr(node.config, "connector", ""))
        if connector in names:
            continue
        problems.append(
            _located_at(
                pipeline,
                marks,
                ("nodes", node.id, "config", "connector"),
                f'vLLM has no KV connector "{connector}"{did_you_mean(connector, names)}; '
                f"registered: {one_of(names)} (set module_path for an out-of-tree connector)",
            )
        )
    return problems


def _nixl_poll_problems(
    pipeline: ResolvedPipeline, marks: Marks, natives: list[ResolvedNode]
) -> list[Problem]:
    """``nixl_poll_ms`` set where the installed NIXL cannot take it."""
    wanted = [n for n in natives if getattr(n.config, "nixl_poll_ms", None) is not None]
    why = nixl_poll_problem() if wanted else ""
    if not why:
        return []
    return [
        _located_at(pipeline, marks, ("nodes", n.id, "config", "nixl_poll_ms"), why)
        for n in wanted
    ]


# --------------------------------------------------------------------------- #
# node classes
# --------------------------------------------------------------------------- #


def node_class_problems(node: ResolvedNode) -> list[str]:
    """What is wrong with the classes of ``node``'s plugin type, one message each."""
    ptype = node.plugin
    out: list[str] = []
    refs = ptype.class_refs()
    # One class for both processes (``node=``) is checked once.
    labelled = (
        {"class": ptype.node}
        if ptype.node is not None
        else {f"{role} class": ref for role, ref in refs.items()}
    )
    for label, ref in labelled.items():
        what = f'plugin type "{ptype.name}": {label} {_show(ref)}'
        try:
            obj = _resolve(ref)
        except _NotFound as exc:
            out.append(f"{what}: {exc}")
            continue
        except Exception as exc:  # the plugin's module raised while importing
            out.append(f"{what} failed to import: {type(exc).__name__}: {exc}")
            continue
        if not isinstance(obj, type):  # chosen from the config: check the one chosen
            try:
                obj = choose_class(obj, node.config, f'plugin type "{ptype.name}"')
            except Exception as exc:
                out.append(f"{what} failed choosing the class: {type(exc).__name__}: {exc}")
                continue
            what += f" (chose {_show(obj)})"
        out += [f"{what}: {m}" for m in class_problems(obj)]
        out += _launch_problems(obj, node.config, what)
    return out


def _launch_problems(cls: type, config: object, what: str) -> list[str]:
    """The class's own :meth:`~composer.plugin.Plugin.launch_problems` for ``config``."""
    check = getattr(cls, "launch_problems", None)
    if not callable(check):
        return []
    try:
        return [str(m) for m in check(config)]
    except Exception as exc:  # the plugin's own check raised: its bug, said as such
        return [f"{what} failed checking what it needs: {type(exc).__name__}: {exc}"]


#: What a node that holds vLLM's KV caches implements to follow vLLM's sleep mode.
SLEEP_HOOKS = ("unregister_kv_caches", "restore_kv_caches")


def cannot_sleep(node: ResolvedNode) -> str:
    """Why a plugin node cannot follow vLLM's sleep mode, or "" if it can (its
    plugin type's ``sleep_mode``, else its worker class: imports it). A ``vllm``
    node's connector class answers for itself (:mod:`composer.vllm.pipeline_source`)."""
    declared = node.capabilities.sleep_mode
    if declared is not None:
        return "" if declared else f'plugin type "{node.plugin.name}" declares sleep_mode=False'
    if "worker" not in node.plugin.processes:
        return ""  # nothing of it touches vLLM's KV caches
    hooks = _impl_names(node.plugin.node_class("worker", node.config))
    missing = [h for h in SLEEP_HOOKS if h not in hooks]
    if "register_kv_caches" not in hooks or not missing:
        return ""
    return (
        f'plugin "{node.plugin.name}" holds vLLM\'s KV caches (register_kv_caches) but '
        f"implements no {' / '.join(missing)}, so its views would outlive the memory "
        "vLLM releases while asleep"
    )


def class_problems(cls: type) -> list[str]:
    """A node class's problems: base class, hook names and arguments, options."""

    if not issubclass(cls, Plugin):
        return ["does not subclass composer.plugin.Plugin"]
    spec_names = list(HOOKS)
    out = [
        f'"{hook}" is not a hook{did_you_mean(hook, spec_names)}'
        for hook in _impl_options(cls)
        if hook not in spec_names
    ]
    out += _argument_problems(cls, spec_names)
    out += [
        f'hook "{hook}" is marked {option}=True, which the chain does not honour '
        "(nodes are called once each, in pipeline order)"
        for hook, option in unsupported_hookimpl_options(cls)
    ]
    if out:
        return out
    # What pluggy itself refuses (the chain registers nodes the same way).
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(NodeSpec)
    try:
        pm.register(cls)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        out.append("; ".join(line.strip() for line in str(exc).splitlines() if line.strip()))
    return out


def _argument_problems(cls: type, spec_names: list[str]) -> list[str]:
    out = []
    for hook, name in _impl_names(cls).items():
        if hook not in spec_names:
            continue
        spec = _argnames(getattr(NodeSpec, hook))
        for arg in _argnames(getattr(cls, name)):
            if arg not in spec:
                out.append(
                    f'hook "{hook}" has no argument "{arg}"{did_you_mean(arg, spec)}; '
                    f"it passes: {', '.join(spec) or '(none)'}"
                )
    return out


def _argnames(fn: object) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # As pluggy reads a hookimpl: arguments with defaults are not asked for.
    return [p.name for p in params[1:] if p.kind in positional and p.default is p.empty]


def unsupported_hookimpl_options(cls: type) -> list[tuple[str, str]]:
    """``(hook, option)`` for each hookimpl option of ``cls`` the chain does not honour."""
    return [
        (hook, option)
        for hook, opts in _impl_options(cls).items()
        for option in UNHONOURED_OPTIONS
        if opts.get(option)
    ]


def _impl_options(cls: type) -> dict[str, dict[str, object]]:
    """Hook name -> the ``@hookimpl`` options of each hook implementation of ``cls``."""
    return {
        hook: getattr(getattr(cls, name), _IMPL_ATTR) for hook, name in _impl_names(cls).items()
    }


def _impl_names(cls: type) -> dict[str, str]:
    """Hook name -> the name of the method of ``cls`` implementing it."""
    found: dict[str, str] = {}
    for name in dir(cls):
        opts = getattr(getattr(cls, name, None), _IMPL_ATTR, None)
        if isinstance(opts, dict):
            found[str(opts.get("specname") or name)] = name
    return found


class _NotFound(Exception):
    """A ``"module:Class"`` names a module or attribute that does not exist."""


def _show(ref: ClassRef) -> str:
    if isinstance(ref, str):
        return f'"{ref}"'
    return f"{getattr(ref, '__module__', '?')}.{getattr(ref, '__qualname__', repr(ref))}"


def _resolve(ref: ClassRef) -> object:
    """What ``ref`` names; :class:`_NotFound` (with did-you-mean) when it does not exist."""
    if not isinstance(ref, str):
        return ref
    module_name = ref.partition(":")[0]
    try:
        # The module on its own first: an error of its own code is no missing name.
        importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # the module exists, one of its own imports does not
        raise _NotFound(f'no module "{exc.name}"{_module_hint(exc.name)}') from None
    try:
        obj = resolve_ref(ref)
    except AttributeError as exc:  # the name a step of "Class.Inner" misses, and where
        holder, name = exc.obj, str(exc.name)
        names = [n for n in dir(holder) if isinstance(getattr(holder, n), type)]
        raise _NotFound(
            f'"{getattr(holder, "__name__", holder)}" has no class "{name}"'
            f"{did_you_mean(name, names)}"
        ) from None
    except ValueError:  # pkgutil.resolve_name's grammar: dotted names, one colon
        raise _NotFound('is not a "module:Class" name') from None
    if not (isinstance(obj, type) or callable(obj)):
        raise _NotFound(f"is a {type(obj).__name__}, not a class")
    return obj


def _module_hint(missing: str) -> str:
    """Did-you-mean among the missing module's siblings (its package's submodules, or
    every importable top-level module)."""
    parent, _, _ = missing.rpartition(".")
    try:
        search = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return ""
    prefix = parent + "." if parent else ""
    names = [prefix + m.name for m in pkgutil.iter_modules(search)]
    # Not errors.did_you_mean: it gives up on long lists, and a venv has many modules.
    close = difflib.get_close_matches(missing, names, n=1, cutoff=0.8)
    return f' (did you mean "{close[0]}"?)' if close else ""
