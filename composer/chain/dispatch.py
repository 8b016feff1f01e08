"""Dispatch: callables that run one hook's call list with each node's faults caught.

Per-layer hooks (and per-step hooks with no result) get a callable specialised
for their list: a fixed number of arguments and, for one node, no loop, since
on the per-layer path each Python call shows (``make bench``: composed vs
MultiConnector). Everything else is a plain loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from composer.chain.calls import Call, takes_kwargs

Fault = Callable[[str, str, BaseException], None]
Calls = list[tuple[str, Call]]


def call_each(hook: str, calls: Calls, fault: Fault, arity: int) -> Call:
    """Call every node with the same arguments; nothing returned."""
    if not calls:
        return noop
    if len(calls) == 1:
        return _call_one(hook, calls[0], fault, arity)
    if arity == 0:

        def each0() -> None:
            for node_id, fn in calls:
                try:
                    fn()
                except Exception as exc:
                    fault(node_id, hook, exc)

        return each0
    if arity == 1:

        def each1(a: Any) -> None:
            for node_id, fn in calls:
                try:
                    fn(a)
                except Exception as exc:
                    fault(node_id, hook, exc)

        return each1
    if arity == 3:

        def each3(a: Any, b: Any, c: Any) -> None:
            for node_id, fn in calls:
                try:
                    fn(a, b, c)
                except Exception as exc:
                    fault(node_id, hook, exc)

        return each3

    def each(*args: Any) -> None:
        for node_id, fn in calls:
            try:
                fn(*args)
            except Exception as exc:
                fault(node_id, hook, exc)

    return each


def _call_one(hook: str, call: tuple[str, Call], fault: Fault, arity: int) -> Call:
    # A call with fixed arguments costs less than one with *args.
    node_id, fn = call
    if arity == 0:

        def one0() -> None:
            try:
                fn()
            except Exception as exc:
                fault(node_id, hook, exc)

        return one0
    if arity == 1:

        def one1(a: Any) -> None:
            try:
                fn(a)
            except Exception as exc:
                fault(node_id, hook, exc)

        return one1
    if arity == 3:

        def one3(a: Any, b: Any, c: Any) -> None:
            try:
                fn(a, b, c)
            except Exception as exc:
                fault(node_id, hook, exc)

        return one3

    def one(*args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            fault(node_id, hook, exc)

    return one


def call_each_passing_kwargs(hook: str, calls: Calls, fault: Fault) -> Call:
    """:func:`call_each`, with vLLM's keyword arguments for the callables that take them."""
    entries = [(node_id, fn, takes_kwargs(fn)) for node_id, fn in calls]

    def each_passing_kwargs(*args: Any, **kwargs: Any) -> None:
        for node_id, fn, fn_takes_kwargs in entries:
            try:
                if kwargs and fn_takes_kwargs:
                    fn(*args, **kwargs)
                else:
                    fn(*args)
            except Exception as exc:
                fault(node_id, hook, exc)

    return each_passing_kwargs


def call_each_or_pass_kwargs(hook: str, calls: Calls, fault: Fault, arity: int) -> Call:
    """:func:`call_each` (fixed arguments, no wrapper) for vLLM's usual call; a call
    with keyword arguments goes to :func:`call_each_passing_kwargs`."""
    each = call_each(hook, calls, fault, arity)
    passing = call_each_passing_kwargs(hook, calls, fault)
    if arity == 3:

        def each3_or_kwargs(a: Any, b: Any, c: Any, **kwargs: Any) -> None:
            if kwargs:
                passing(a, b, c, **kwargs)
            else:
                each(a, b, c)

        return each3_or_kwargs
    if arity == 1:

        def each1_or_kwargs(a: Any, **kwargs: Any) -> None:
            if kwargs:
                passing(a, **kwargs)
            else:
                each(a)

        return each1_or_kwargs

    def each_or_kwargs(*args: Any, **kwargs: Any) -> None:
        if kwargs:
            passing(*args, **kwargs)
        else:
            each(*args)

    return each_or_kwargs


def any_true(hook: str, calls: Calls, fault: Fault) -> Callable[[], bool]:
    if not calls:
        return false

    def any_node_true() -> bool:
        found = False  # every node is asked, as with any()
        for node_id, fn in calls:
            try:
                if fn():
                    found = True
            except Exception as exc:
                fault(node_id, hook, exc)
        return found

    return any_node_true


def results(
    hook: str, calls: Calls, fault: Fault, args: tuple[Any, ...], default: Any = None
) -> list[tuple[str, Any]]:
    """(node id, result) of every node; a failed node yields ``default``.

    For one-time and per-request hooks (their callables are timed when bound).
    """
    out = []
    for node_id, fn in calls:
        try:
            result = fn(*args)
        except Exception as exc:
            fault(node_id, hook, exc)
            result = default
        out.append((node_id, result))
    return out


def noop(*args: Any) -> None:
    return None


def none() -> None:
    return None


def false() -> bool:
    return False


def no_events() -> Iterable[Any]:
    return ()


def drop_args(fn: Call) -> Call:
    return lambda *args: fn()
