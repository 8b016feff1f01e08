"""Binding calls: each hook's list of (node id, callable), built once from pluggy.

pluggy is the registry, the validator (``check_pending``) and the tracer; the
calls themselves go through these lists, in pipeline order, so a node that does
not implement a hook costs nothing and a per-layer hook is a plain loop (``make bench``
measures it against MultiConnector). Lists are rebuilt only when a node is
switched off.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from composer.hook_table import HOOKS
from composer.stats import NodeStats

Call = Callable[..., Any]


@dataclass
class CallLists:
    """Every hook's calls, in dispatch order, without switched-off nodes."""

    #: Hook -> (node id, callable taking the spec's arguments positionally).
    calls: dict[str, list[tuple[str, Call]]] = field(default_factory=dict)
    #: Hook -> (node id, callable taking its hookimpl's own arguments, their names).
    own: dict[str, list[tuple[str, Call, tuple[str, ...]]]] = field(default_factory=dict)
    #: Hook -> the spec arguments some implementing node names (the rest may be None).
    wanted: dict[str, set[str]] = field(default_factory=dict)
    #: Hook -> the spec's argument names.
    spec_args: dict[str, tuple[str, ...]] = field(default_factory=dict)


def bind_calls(
    pm: pluggy.PluginManager,
    order_for: Callable[[str], list[str]],
    directs: Mapping[str, Mapping[str, Call | None]],
    wrap: Callable[[str, str, Call], Call],
) -> CallLists:
    """The call lists of every hook, nodes in ``order_for(hook)``.

    ``directs``: per node, its ``direct_hooks()`` (callables bound straight into
    the lists, or None for a hook it implements that would do nothing).
    ``wrap(node_id, hook, fn)``: timing or tracing around a node's callable.
    """
    lists = CallLists()
    for name in HOOKS:
        caller = getattr(pm.hook, name)
        spec_args = tuple(caller.spec.argnames)
        lists.spec_args[name] = spec_args
        impls = {impl.plugin_name: impl for impl in caller.get_hookimpls()}
        lists.calls[name], lists.own[name], lists.wanted[name] = [], [], set()
        for node_id in order_for(name):
            if node_id not in impls:
                continue
            direct = directs.get(node_id, {})
            fast = direct.get(name)
            if fast is None and name in direct:
                continue
            argnames = tuple(impls[node_id].argnames)
            fn = wrap(node_id, name, fast if fast is not None else impls[node_id].function)
            lists.own[name].append((node_id, fn, argnames))
            lists.calls[name].append((node_id, adapt(fn, argnames, spec_args)))
            lists.wanted[name].update(argnames)
    return lists


def adapt(fn: Call, argnames: tuple[str, ...], spec_args: tuple[str, ...]) -> Call:
    """``fn`` takes ``argnames`` (some of ``spec_args``, in spec order): make it take them all."""
    if argnames == spec_args:
        return fn
    index = [spec_args.index(a) for a in argnames]
    # The usual shapes get a wrapper that builds no list per call.
    if not index:
        return lambda *args: fn()
    if len(index) == 1:
        (i,) = index
        return lambda *args: fn(args[i])
    if len(index) == 2:
        i, j = index
        return lambda *args: fn(args[i], args[j])
    return lambda *args: fn(*[args[i] for i in index])


def timed(fn: Call, stats: NodeStats, hook: str) -> Call:
    clock = time.perf_counter

    def timed_call(*args: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args)
        finally:
            stats.add_time(hook, clock() - t0)

    return timed_call


def traced(fn: Call, node_id: str, hook: str, pm: pluggy.PluginManager) -> Call:
    """``fn`` reporting each call and its result through pluggy's tracer."""
    trace = pm.trace.root.get("hook")

    def traced_call(*args: Any, **kwargs: Any) -> Any:
        trace(f"{hook} node={node_id}", _short(args))
        result = fn(*args, **kwargs)
        trace(f"{hook} node={node_id} ->", _short((result,)))
        return result

    return traced_call


def _short(values: Iterable[Any], limit: int = 80) -> str:
    text = ", ".join(repr(v) for v in values)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def takes_kwargs(fn: Call) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
