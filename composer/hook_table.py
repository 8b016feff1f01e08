"""The hook table: each lifecycle hook's behaviour, one row per hook.

A row says which vLLM process calls the hook and how often, how the nodes'
results combine, what ``on_error: recompute`` does with a failure, what a store
away does, which nodes the hook is dispatched to, and how the built-in ``vllm``
node forwards it. The chain's call lists, fault policy and step timing, the
native node's forwarding, the docs' hook table (:func:`markdown_table`) and the
combine and fault tests all read :data:`HOOKS`.

Each row is declared once, on its spec in :mod:`composer.hookspecs`
(``@hook(...)``, the way pytest declares ``firstresult`` on a hookspec), and
recorded here by :func:`row` as ``NodeSpec`` is defined.

Adding a hook (as vLLM adds a connector method), each step checked by a test:

1. its spec in :mod:`composer.hookspecs`, with its row (``@hook(...)``); paste
   :func:`markdown_table` into ``docs/hooks.md``;
2. the method of the same name on the chain of the process that calls it
   (``SchedulerChain``, ``WorkerChain``, or ``ChainCore`` for either, in
   ``chain/``), which ``ComposedConnector``'s method of that name calls;
3. its vLLM arguments in :func:`composer.testing.chains.sample_args`, with
   which the combine and fault tests drive it;
4. for the ``vllm`` node: nothing when its row says ``as is``; a hookimpl on
   ``NativeConnectorNode`` taking vLLM's arguments when ``direct``, or
   converting them when ``adapted``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

Spec = TypeVar("Spec", bound=Callable[..., Any])


class Process(StrEnum):
    """The vLLM process that calls a hook."""

    SCHEDULER = "scheduler"
    WORKER = "worker"
    EITHER = "either"


class Every(StrEnum):
    """How often vLLM calls a hook. Per-layer and per-step hooks are timed in the
    per-node stats only with ``time_layer_hooks`` / ``time_step_hooks``; the rest always."""

    ONCE = "once"
    ON_DEMAND = "on demand"
    REQUEST = "per request"
    STEP = "per step"
    LAYER = "per layer"


class Combine(StrEnum):
    """How the chain combines the nodes' results of one hook into what vLLM gets."""

    CALL_EACH = "call each"
    """Every implementing node is called in order; nothing is returned."""
    AT_MOST_ONE = "at most one"
    """The one non-None result, or None; two non-None results are an error."""
    FIRST_NOT_NONE = "first not None"
    """The first non-None result in node order, or None."""
    CHOSEN_NODE = "chosen node"
    """Only the nodes serving the request are asked (one per range); the answer, or
    vLLM's default (several ranges: hit sources summed, KV cache groups united)."""
    LOAD_POLICY = "load policy"
    """Asked in load order: None from any node is None; else the first or longest hit,
    or under ``ranges`` each node's hit after the nodes before it, summed."""
    ANY_TRUE = "any true"
    """True if any node returns True (every node is still asked)."""
    NOT_ANY_FALSE = "not any false"
    """True unless some node returns False."""
    ALL_EQUAL = "all equal"
    """The common value; None if any node says None; different values are an error."""
    UNION = "union"
    """The union of the nodes' sets."""
    CONCATENATE = "concatenate"
    """The nodes' iterables, one after the other, in node order."""
    MERGE = "merge"
    """``a.merge(b)`` over the non-None results, in node order."""
    HOLD_ANY_PARAMS_NO_CLASH = "hold if any, params merged without clash"
    """(any node holds, merged params); a params key written by two nodes is an error, but
    ``kv_composer``, whose entries (one per node under a key, ``retention.<node>``)
    are merged beside the chain's note."""
    PER_NODE = "per node"
    """A dict keyed by node id, delivered back to the same node (in the other process)."""
    DONE_WHEN_ALL_HOLDERS = "done when all holders are"
    """Finished loads: union; finished saves: a request when every node holding it is."""


class Recompute(StrEnum):
    """What a node's failure in a hook does under ``on_error: recompute``."""

    SWITCH_OFF = "switched off"
    """The node's two halves may be out of step, or a transfer still in flight, and
    vLLM has no call that cancels either: the node is switched off, as ``disable``."""
    RESULT_LOST = "result lost"
    """Only this call's result is lost (a lookup is a miss, a report is skipped)."""
    BLOCKS_RECOMPUTED = "blocks recomputed"
    """The blocks the node loads this step become load errors, which vLLM recomputes;
    switched off instead while the node has an async load in flight."""


class Away(StrEnum):
    """What a node's :class:`~composer.Unavailable` (its store is away) does in a hook.
    Not a fault: under every ``on_error`` policy the node stays on and is counted."""

    MISS = "a miss"
    """The lookup found nothing; vLLM computes the request."""
    RESULT_LOST = "result lost"
    """Only this call's result is lost (a report is skipped)."""
    BLOCKS_RECOMPUTED = "blocks recomputed"
    """The blocks the node loads this step become load errors, which vLLM recomputes
    (the node still reports finished any async load it had started)."""
    SAVE_SKIPPED = "save skipped"
    """Nothing is saved and the request's blocks are not held for the node."""
    FAULT = "a fault"
    """The hook has no such meaning (the node's two halves could be out of step):
    the node's ``on_error`` applies."""


class Nodes(StrEnum):
    """The nodes a hook is dispatched to, and in which order."""

    ALL = "every node"
    """Every node, in pipeline order."""
    LOADERS_IN_LOAD_ORDER = "load order"
    """The nodes of ``load_order``, in that order (a lookup asks them so)."""
    LOADERS = "loaders"
    """The nodes of ``load_order``, in pipeline order."""
    SAVERS = "savers"
    """The nodes of ``save_to``, in pipeline order."""


class Native(StrEnum):
    """How the built-in ``vllm`` node forwards a hook to its vLLM connector."""

    AS_IS = "as is"
    """vLLM's method of the same name takes the spec's arguments: a generated
    hookimpl, and a direct call to the connector's method in the call list."""
    DIRECT = "direct"
    """The node's hookimpl takes exactly vLLM's arguments (a subset of the spec's):
    a direct call to the connector's method in the call list."""
    ADAPTED = "adapted"
    """The node's hookimpl converts the arguments (a request view's raw request, ...)."""
    NOT = "not forwarded"
    """vLLM's connectors have no such method (or the chain asks another one)."""


@dataclass(frozen=True)
class Hook:
    """One lifecycle hook's row of the table."""

    name: str
    process: Process
    every: Every
    combine: Combine
    recompute: Recompute
    away: Away
    nodes: Nodes
    native: Native
    #: vLLM base-class methods behind the hook: a ``vllm`` node whose connector
    #: keeps vLLM's do-nothing default for all of them is left out of the call list.
    skip_if_default: tuple[str, ...]
    #: The call reaches the node's store every time it is made, so one that
    #: returns normally ends the node's outage (a lookup, load or save of a step;
    #: ``request_finished`` and the per-layer hooks need not touch the store).
    store_call: bool
    #: vLLM's method also takes ``**kwargs`` (0.32.0 passes none; later versions
    #: may): the chain hands them to the nodes' callables that take them.
    passes_kwargs: bool
    #: The hookspec itself (``NodeSpec``'s method): its arguments and docstring.
    spec: Callable[..., Any] = field(repr=False, compare=False)

    @property
    def signature(self) -> str:
        """``name(arg, ...)``: the spec's argument names (a hookimpl names any of them)."""
        return f"{self.name}({', '.join(pluggy_argnames(self.spec))})"


#: Every lifecycle hook, in spec order. Filled by :func:`row` as
#: ``composer.hookspecs`` defines ``NodeSpec``: that module imports this one, never
#: the reverse (no import circle), and ``import composer`` (which any
#: ``composer.*`` import runs first) imports it, so importing either module gives
#: the complete table. Nothing here reads the table while this module loads: what
#: is derived from it at import time (``STORE_CALLS``) is in ``composer.hookspecs``.
HOOKS: dict[str, Hook] = {}


def row(
    process: Process,
    every: Every,
    combine: Combine,
    native: Native,
    *,
    recompute: Recompute = Recompute.SWITCH_OFF,
    away: Away | None = None,
    nodes: Nodes = Nodes.ALL,
    skip_if_default: bool | tuple[str, ...] = False,
    store_call: bool = False,
    passes_kwargs: bool = False,
) -> Callable[[Spec], Spec]:
    """A decorator recording its hookspec's row in :data:`HOOKS`: the four cells
    every hook declares, then those where it differs from most.

    ``away`` defaults to what ``recompute`` says: what vLLM's recompute undoes
    after a fault, it undoes after an outage too. A store call's outage is never
    a fault (a store call that returns ends the outage).
    """
    if away is None:
        away = {
            Recompute.RESULT_LOST: Away.RESULT_LOST,
            Recompute.BLOCKS_RECOMPUTED: Away.BLOCKS_RECOMPUTED,
        }.get(recompute, Away.FAULT)
    if store_call and away is Away.FAULT:
        raise ValueError("a store call's outage ends when it returns: it cannot be a fault")

    def record(spec: Spec) -> Spec:
        name = spec.__name__
        skip = (name,) if skip_if_default is True else skip_if_default or ()
        cells = (process, every, combine, recompute, away, nodes, native, skip)
        HOOKS[name] = Hook(name, *cells, store_call, passes_kwargs, spec)
        return spec

    return record


def pluggy_argnames(fn: Callable[..., Any]) -> tuple[str, ...]:
    """A hookspec's argument names as pluggy passes them (``self`` left out)."""
    return tuple(inspect.signature(fn).parameters)[1:]


def hooks_where(**cells: Any) -> tuple[str, ...]:
    """The hooks whose row has these values, in spec order: ``hooks_where(every=Every.STEP)``."""
    return tuple(
        name for name, h in HOOKS.items() if all(getattr(h, k) == v for k, v in cells.items())
    )


def markdown_table() -> str:
    """``docs/hooks.md``'s hook table (``tests/test_hookspecs.py`` checks it is current)."""
    rows = [
        "| hook | process | called | combine | on `recompute` | store away | nodes | `vllm` node "
        "| what |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for h in HOOKS.values():
        doc = (h.spec.__doc__ or "").strip().splitlines()[0]
        rows.append(
            f"| `{h.signature}` | {h.process} | {h.every} | {h.combine} | {h.recompute} "
            f"| {h.away}{'; a return ends the outage' if h.store_call else ''} | {h.nodes} "
            f"| {h.native}{' (and `**kwargs`)' if h.passes_kwargs else ''} "
            f"| {doc.replace('|', '/')} |"
        )
    return "\n".join(rows) + "\n"
