"""Disaggregated prefill/decode (P/D) as a pipeline shape: one file, both sides.

The prefill engine (vLLM's ``kv_producer``) and the decode engine
(``kv_consumer``) run the same pipeline file; which side an engine plays comes
from where it runs (``kvc serve --kv-role``, ``load_pipeline(kv_role=...)``),
else from the file's ``kv_role``. A *transport* node moves the prompt's KV
from one side to the other (NIXL, say); the other nodes are tiers each side
keeps for itself. The rules, checked for the side an engine plays:

* the consumer side needs a transport node that loads (else a decode engine
  never receives what the prefill engine computed: it recomputes every
  prompt, silently); the producer side one that saves (else nothing ships);
* at most one transport node per side, unless ``sides`` puts them on different
  sides (two transports would both answer for the same request);
* a node that runs on a side can only need nodes that run there too.

A ``vllm`` node not marked ``transport`` counts as one for the first rule: vLLM
configures its connector with the engine's ``kv_role`` itself, as
MultiConnector does its children (so MultiConnector JSON keeps its meaning).
This module is also where what each node does on each side is described
(``kvc graph``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer.errors import Reporter, one_of
from composer.pipeline import (
    LOADING_ROLES,
    SAVING_ROLES,
    SIDES,
    KVRole,
    ResolvedNode,
    ResolvedPipeline,
    Side,
    sides_of,
)

#: What the side needs of its transport: the role set and the pipeline list that
#: must hold it, and the verb for messages.
_NEEDS = {
    "consumer": (
        LOADING_ROLES, "load_order", "loads", "receive the prompt's KV from the prefill side"
    ),
    "producer": (SAVING_ROLES, "save_to", "saves", "ship the prompt's KV to the decode side"),
}


def node_sides(raw: Mapping[str, Any]) -> tuple[Side, ...]:
    """The sides a node (as written in the file) runs on; both when it does not say."""
    sides = raw.get("sides")
    if not isinstance(sides, list):
        return SIDES
    # (Values that are no side have been reported; what is left decides.)
    return tuple(s for s in SIDES if any(s == given for given in sides)) or SIDES


def check_pd(
    data: dict[str, Any],
    kv_role: KVRole,
    given: bool,
    roles: Mapping[str, str],
    native: set[str],
    reporter: Reporter,
) -> None:
    """Report what keeps this pipeline from running as ``kv_role``'s side.

    ``given``: the role was given where the pipeline runs, not by the file's
    ``kv_role``; ``roles``: each known node's role; ``native``: ids of
    ``plugin: vllm`` nodes.
    """
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, dict):
        return
    nodes = {
        k: v for k, v in raw_nodes.items()
        if isinstance(v, dict) and v.get("enabled") is not False and k in roles
    }
    _check_sides_lists(nodes, reporter)
    sides = {k: node_sides(v) for k, v in nodes.items()}
    _check_one_transport_per_side(nodes, roles, sides, reporter)
    active = {k for k in nodes if set(sides[k]) & set(sides_of(kv_role))}
    _check_needs_on_side(nodes, active, sides, kv_role, reporter)
    for side in sides_of(kv_role) if kv_role != "kv_both" else ():
        _check_side_has_transport(data, side, kv_role, given, roles, native, active, reporter)


def _check_sides_lists(nodes: Mapping[str, Any], reporter: Reporter) -> None:
    for node_id, node in nodes.items():
        sides = node.get("sides")
        if not isinstance(sides, list):
            continue
        seen: set[str] = set()
        for i, side in enumerate(sides):
            if not isinstance(side, str):
                continue  # reported by the Pipeline model
            if side in seen:
                reporter.add(("nodes", node_id, "sides", i), f'side "{side}" is listed twice')
            seen.add(side)


def _check_one_transport_per_side(
    nodes: Mapping[str, Any],
    roles: Mapping[str, str],
    sides: Mapping[str, tuple[Side, ...]],
    reporter: Reporter,
) -> None:
    for side in SIDES:
        transports = [n for n in nodes if roles[n] == "transport" and side in sides[n]]
        for extra in transports[1:]:
            reporter.add(
                ("nodes", extra, "role"),
                f'both "{transports[0]}" and "{extra}" are transport nodes on the {side} side; '
                "at most one transport per side (give them different sides: "
                '"sides: [producer]" / "sides: [consumer]", or remove one)',
            )


def _check_needs_on_side(
    nodes: Mapping[str, Any],
    active: set[str],
    sides: Mapping[str, tuple[Side, ...]],
    kv_role: KVRole,
    reporter: Reporter,
) -> None:
    for node_id in nodes:
        deps = nodes[node_id].get("needs")
        if node_id not in active or not isinstance(deps, list):
            continue
        for i, dep in enumerate(deps):
            if isinstance(dep, str) and dep in nodes and dep not in active:
                reporter.add(
                    ("nodes", node_id, "needs", i),
                    f'node "{dep}" runs only on the {_side_list(sides[dep])} side, so not on a '
                    f'{kv_role} engine, where "{node_id}" runs and needs it',
                )


def _check_side_has_transport(
    data: dict[str, Any],
    side: Side,
    kv_role: KVRole,
    given: bool,
    roles: Mapping[str, str],
    native: set[str],
    active: set[str],
    reporter: Reporter,
) -> None:
    wanted_roles, order_key, verb, why = _NEEDS[side]
    # A transport node, or a vllm node vLLM itself configures for this side.
    candidates = [
        n for n in active
        if roles[n] == "transport" or (n in native and roles[n] in wanted_roles)
    ]
    order = data.get(order_key)
    listed = order if isinstance(order, list) else None
    if candidates and listed is not None and not any(n in listed for n in candidates):
        reporter.add(
            (order_key,),
            f"the {side} side ({kv_role}) {verb} through its transport node "
            f'"{sorted(candidates)[0]}", but {order_key} leaves it out',
        )
        return
    if candidates:
        return
    # At the file's kv_role when that is where the side comes from; else at the nodes.
    where: tuple[str, ...] = ("nodes",) if given else ("kv_role",)
    source = ", given where it runs" if given else ""
    reporter.add(
        where,
        f"the {side} side ({kv_role}{source}) needs a transport node that {verb}, to {why}: "
        "a node with role: transport (e.g. plugin: vllm, connector: NixlConnector), or a "
        f"plugin: vllm node; nodes on this side: {one_of(active)}",
    )


def _side_list(sides: tuple[Side, ...]) -> str:
    return " and ".join(sides)


# --------------------------------------------------------------------------- #
# What each node does on each side (kvc graph)
# --------------------------------------------------------------------------- #


def side_actions(pipeline: ResolvedPipeline, node: ResolvedNode, side: Side) -> str:
    """One line: what ``node`` does on ``side`` ("" when it does not run there)."""
    if side not in node.sides:
        return ""
    loads = node.id in pipeline.load_order
    saves = node.id in pipeline.save_to
    if node.role == "transport":
        if side == "consumer":
            if not loads:
                return "receives nothing (not in load_order)"
            return "receives the prompt's KV from the prefill engine"
        return "ships the prompt's KV to the decode engine" if saves else (
            "ships nothing (not in save_to)"
        )
    made = "the prompts it prefills" if side == "producer" else "what arrives and what decode adds"
    what = ["serves prefixes it holds" if loads else "", f"saves {made}" if saves else ""]
    return "; ".join(w for w in what if w) or f"{node.role} (no KV)"


def is_pd(pipeline: ResolvedPipeline) -> bool:
    """Whether the pipeline is shaped for P/D: a transport node, a node on one side
    only, or an engine that plays one side."""
    return pipeline.kv_role != "kv_both" or any(
        n.role == "transport" or n.sides != SIDES for n in pipeline.nodes
    )


def sides_table(pipeline: ResolvedPipeline) -> dict[str, dict[str, str]]:
    """``{node id: {side: action}}`` for every node, both sides."""
    return {n.id: {s: side_actions(pipeline, n, s) for s in SIDES} for n in pipeline.nodes}
