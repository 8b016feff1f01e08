"""Graph checks across nodes: ids, dependencies, cycles, roles and capabilities."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel

from composer.discovery import Registry, call_plugin
from composer.errors import Reporter, did_you_mean, one_of
from composer.pipeline import LOADING_ROLES, SAVING_ROLES
from composer.plugin_types import Capabilities, NodeRole


def dependency_order(needs: Mapping[str, Sequence[str]]) -> list[str]:
    """Node ids with every node after the nodes it needs; file order otherwise kept.

    A depth-first post-order with an explicit stack: a ``needs`` chain as long
    as the file allows must not reach Python's recursion limit.
    """
    done: list[str] = []
    seen: set[str] = set()
    for root in needs:
        if root in seen:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(root, iter(needs[root]))]
        on_stack = {root}
        while stack:
            node, deps = stack[-1]
            for dep in deps:
                if dep in needs and dep not in seen and dep not in on_stack:
                    stack.append((dep, iter(needs[dep])))
                    on_stack.add(dep)
                    break
            else:
                stack.pop()
                on_stack.discard(node)
                seen.add(node)
                done.append(node)
    return done


def find_cycles(needs: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Each elementary cycle met by a depth-first walk once, as a path that ends where it
    starts (iterative, like :func:`dependency_order`)."""
    cycles: list[list[str]] = []
    found: set[frozenset[str]] = set()
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    for root in needs:
        if root in state:
            continue
        path: list[str] = [root]
        position = {root: 0}
        state[root] = 1
        stack: list[Iterator[str]] = [iter(needs[root])]
        while stack:
            for dep in stack[-1]:
                if dep not in needs:
                    continue
                if state.get(dep) == 1:
                    cycle = path[position[dep] :] + [dep]
                    key = frozenset(cycle)
                    if key not in found:
                        found.add(key)
                        cycles.append(cycle)
                elif dep not in state:
                    state[dep] = 1
                    position[dep] = len(path)
                    path.append(dep)
                    stack.append(iter(needs[dep]))
                    break
            else:
                stack.pop()
                node = path.pop()
                del position[node]
                state[node] = 2
    return cycles


def check_graph(
    data: dict[str, Any],
    registry: Registry,
    configs: dict[str, BaseModel],
    reporter: Reporter,
) -> None:
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, dict):
        return
    nodes = {k: v for k, v in raw_nodes.items() if isinstance(v, dict)}
    ids = list(nodes)
    needs: dict[str, list[str]] = {}
    if (
        nodes
        and len(nodes) == len(raw_nodes)
        and all(n.get("enabled") is False for n in nodes.values())
    ):
        reporter.add(("nodes",), "every node is disabled; enable at least one")

    for node_id, node in nodes.items():
        deps = node.get("needs") or []
        needs[node_id] = [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else []
        for i, dep in enumerate(needs[node_id]):
            if dep == node_id:
                reporter.add(("nodes", node_id, "needs", i), "a node cannot need itself")
            elif dep not in nodes:
                reporter.add(
                    ("nodes", node_id, "needs", i),
                    f'node "{dep}" does not exist{did_you_mean(dep, ids)}; nodes: {one_of(ids)}',
                )
            elif nodes[dep].get("enabled") is False and node.get("enabled") is not False:
                reporter.add(("nodes", node_id, "needs", i), f'node "{dep}" is disabled')
    for cycle in find_cycles(needs):
        if len(cycle) == 2:
            continue  # a self-dependency, reported above
        first = cycle[0]
        index = needs[first].index(cycle[1])
        reporter.add(("nodes", first, "needs", index), "dependency cycle: " + " -> ".join(cycle))

    roles: dict[str, str] = {}
    for node_id, node in nodes.items():
        plugin = node.get("plugin")
        if not isinstance(plugin, str) or plugin not in registry:
            continue
        ptype = registry[plugin]
        role = node.get("role") or ptype.default_role
        roles[node_id] = role if isinstance(role, str) else ptype.default_role
        # Checked whether or not the node's config is valid: every problem at once.
        # (A role that is no role at all has been reported by the Pipeline model.)
        if roles[node_id] in get_args(NodeRole) and roles[node_id] not in ptype.roles:
            reporter.add(
                ("nodes", node_id, "role"),
                f'plugin "{ptype.name}" cannot take role "{roles[node_id]}"; '
                f"expected one of {one_of(ptype.roles)}",
            )

    _check_order_list(data, "load_order", nodes, roles, LOADING_ROLES, "load", reporter)
    _check_order_list(data, "save_to", nodes, roles, SAVING_ROLES, "save", reporter)
    _check_capabilities(data, nodes, registry, configs, roles, reporter)


def _check_order_list(
    data: dict[str, Any],
    key: str,
    nodes: dict[str, Any],
    roles: dict[str, str],
    allowed_roles: frozenset[str],
    verb: str,
    reporter: Reporter,
) -> None:
    order = data.get(key)
    if not isinstance(order, list):
        return
    seen: set[str] = set()
    for i, node_id in enumerate(order):
        if not isinstance(node_id, str):
            continue
        if node_id not in nodes:
            reporter.add(
                (key, i),
                f'node "{node_id}" does not exist{did_you_mean(node_id, nodes)}; '
                f"nodes: {one_of(nodes)}",
            )
        elif node_id in seen:
            reporter.add((key, i), f'node "{node_id}" is listed twice')
        elif node_id in roles and roles[node_id] not in allowed_roles:
            reporter.add(
                (key, i),
                f'node "{node_id}" has role "{roles[node_id]}", which does not {verb}; '
                f"roles that {verb}: {one_of(allowed_roles)}",
            )
        seen.add(node_id)


@dataclass
class _Nodes:
    """What the capability checks read: each enabled node's capabilities and config."""

    caps: dict[str, Capabilities]
    configs: dict[str, BaseModel]
    nodes: dict[str, Any]
    data: dict[str, Any]
    reporter: Reporter
    roles: dict[str, str]

    def needs(self, node_id: str) -> list[str]:
        deps = self.nodes[node_id].get("needs")
        return [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else []


def _check_capabilities(
    data: dict[str, Any],
    nodes: dict[str, Any],
    registry: Registry,
    configs: dict[str, BaseModel],
    roles: dict[str, str],
    reporter: Reporter,
) -> None:
    caps = {}
    for node_id, config in configs.items():
        node = nodes[node_id]
        if node.get("enabled") is False:
            continue
        ptype = registry[node["plugin"]]
        caps[node_id] = call_plugin(
            ptype.name, "resolving capabilities", ptype.resolve_capabilities, config
        )
    view = _Nodes(caps, configs, nodes, data, reporter, roles)
    for check in _CAPABILITY_CHECKS:
        check(view)
    _plugin_checks(view, registry)


def _one_provider(view: _Nodes) -> None:
    for attr, what in (
        ("provides_handshake", "the P/D handshake"),
        ("provides_memory_pool", "the KV cache memory pool"),
    ):
        providers = [n for n, c in view.caps.items() if getattr(c, attr)]
        for extra in providers[1:]:
            view.reporter.add(
                ("nodes", extra),
                f'both "{providers[0]}" and "{extra}" provide {what}; at most one node may',
            )


def _layouts_agree(view: _Nodes) -> None:
    layouts = {n: c.kv_layout for n, c in view.caps.items() if c.kv_layout}
    if len(set(layouts.values())) <= 1:
        return
    first = next(iter(layouts))
    for node_id, layout in layouts.items():
        if layout != layouts[first]:
            view.reporter.add(
                ("nodes", node_id),
                f'needs KV cache layout {layout} but "{first}" needs {layouts[first]}; '
                "all nodes must agree",
            )


def _hma_and_groups(view: _Nodes) -> None:
    # A service node never touches a KV block: it needs no HMA support.
    no_hma = [n for n, c in view.caps.items() if not c.hma and view.roles.get(n) != "service"]
    if view.data.get("hma", "auto") == "on":
        for node_id in no_hma:
            view.reporter.add(
                ("nodes", node_id),
                'does not support the hybrid memory allocator, but "hma: on" requires every '
                "node to (set hma: off or auto, or remove the node)",
            )
    for node_id, c in view.caps.items():
        if c.kv_cache_groups != "one":
            continue
        if not isinstance(getattr(view.configs[node_id], "kv_cache_group", None), int):
            view.reporter.add(
                ("nodes", node_id, "config"),
                "handles one KV cache group, so its config needs kv_cache_group: <group index>",
            )
        if no_hma:
            view.reporter.add(
                ("nodes", node_id),
                f'handles one KV cache group and needs HMA, but "{no_hma[0]}" does not support '
                "the hybrid memory allocator",
            )


def _transfer_params_keys(view: _Nodes) -> None:
    writers: dict[str, str] = {}
    for node_id, c in view.caps.items():
        for key in sorted(c.transfer_params_keys):
            if key in writers:
                view.reporter.add(
                    ("nodes", node_id),
                    f'writes kv_transfer_params key "{key}", which "{writers[key]}" writes too',
                )
            else:
                writers[key] = node_id


def _model_needs(view: _Nodes) -> None:
    caps = view.caps
    for node_id, c in caps.items():
        deps = view.needs(node_id)
        if c.needs_model and not any(dep in caps and caps[dep].provides_model for dep in deps):
            trackers = [n for n, cc in caps.items() if cc.provides_model]
            hint = f" (add needs: [{trackers[0]}])" if trackers else " (add a model-tracker node)"
            view.reporter.add(
                ("nodes", node_id, "needs"),
                f"needs the model but no dependency provides it{hint}",
            )


_CAPABILITY_CHECKS = (
    _one_provider,
    _layouts_agree,
    _hma_and_groups,
    _transfer_params_keys,
    _model_needs,
)


def _plugin_checks(view: _Nodes, registry: Registry) -> None:
    for node_id, config in view.configs.items():
        ptype = registry[view.nodes[node_id]["plugin"]]
        if ptype.check is not None:
            found = call_plugin(
                ptype.name,
                "checking the pipeline",
                _run_check,
                ptype.check,
                node_id,
                config,
                view.data,
            )
            for path, message in found:
                view.reporter.add(("nodes", node_id, *path), message)


def _run_check(
    check: Any, node_id: str, config: BaseModel, data: dict[str, Any]
) -> list[tuple[tuple[str | int, ...], str]]:
    # Consumed here, inside call_plugin: a generator raises only while iterated.
    out: list[tuple[tuple[str | int, ...], str]] = []
    for path, message in check(node_id, config, data):
        if not isinstance(path, tuple) or not isinstance(message, str):
            raise TypeError(f"check yielded {(path, message)!r}, not (path tuple, message)")
        out.append((path, message))
    return out
