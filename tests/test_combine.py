"""The chain follows the combine table (each hook's ``combine`` in
``composer.hook_table.HOOKS``), hook by hook.

Each rule has a case: three scripted nodes answer the hook, and what the chain
hands vLLM is checked against the rule. A hook added to the spec without a rule,
or a rule without a case, fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from composer.chain import TransferParamsClash
from composer.hook_table import HOOKS, Combine, Every, Nodes, Process
from composer.testing.chains import CALLS, chain, drive, metadata, spec_hooks

#: Each hook's combine rule, from the hook table.
COMBINE: dict[str, Combine] = {name: h.combine for name, h in HOOKS.items()}

NODES = ("a", "b", "c")


def scripted(hook: str, values: tuple[Any, ...], role: str = "scheduler", **settings: Any) -> Any:
    """A chain whose nodes a, b, c return ``values`` from ``hook``."""
    nodes = {n: {"returns": {hook: v}} for n, v in zip(NODES, values, strict=True)}
    return chain(nodes, role, **settings)


def asked(hook: str) -> list[str]:
    return [n for n, h in CALLS if h == hook]


def role_of(hook: str) -> str:
    """The process the chain is built for to drive ``hook`` (either: the scheduler)."""
    return "worker" if HOOKS[hook].process is Process.WORKER else "scheduler"


def call_each(hook: str) -> None:
    c = scripted(hook, (None, None, None), role_of(hook))
    drive(c, hook)
    asked_hook = "get_finished" if hook == "get_transfer_results" else hook
    assert asked(asked_hook) == list(NODES)


def at_most_one(hook: str) -> None:
    assert drive(scripted(hook, (None, "pool", None), "worker"), hook) == "pool"
    with pytest.raises(ValueError, match="Multiple connectors provide a KV cache memory pool"):
        drive(scripted(hook, ("p", None, "q"), "worker"), hook)


def first_not_none(hook: str) -> None:
    assert drive(scripted(hook, (None, "hb", "hc"), "worker"), hook) == "hb"
    assert drive(scripted(hook, (None, None, None), "worker"), hook) is None


def chosen_node(hook: str) -> None:
    c = chain(
        {
            n: {"returns": {hook: n, "get_num_new_matched_tokens": hit}}
            for n, hit in zip(NODES, ((0, False), (8, False), (12, False)), strict=True)
        }
    )
    assert drive(c, hook) == "b"
    assert asked(hook) == ["b"]


def load_policy(hook: str) -> None:
    hits = ((0, False), (8, True), (12, False))
    assert drive(scripted(hook, hits), hook) == (8, True)
    assert drive(scripted(hook, hits, load_policy="longest_hit"), hook) == (12, False)
    assert drive(scripted(hook, ((0, False), (None, False), (12, False))), hook) == (None, False)
    assert drive(scripted(hook, ((0, False),) * 3), hook) == (0, False)


def any_true(hook: str) -> None:
    assert drive(scripted(hook, (False, True, False)), hook) is True
    assert asked(hook) == list(NODES)  # every node is asked
    assert drive(scripted(hook, (False, False, False)), hook) is False


def not_any_false(hook: str) -> None:
    assert drive(scripted(hook, (None, True, False)), hook) is False
    assert drive(scripted(hook, (None, True, None)), hook) is True


def all_equal(hook: str) -> None:
    assert drive(scripted(hook, (2, 2, 2)), hook) == 2
    assert drive(scripted(hook, (2, None, 2)), hook) is None
    with pytest.raises(ValueError, match="incompatible finished counts"):
        drive(scripted(hook, (2, 3, 2)), hook)


def union(hook: str) -> None:
    assert drive(scripted(hook, ({1}, {2}, {1, 3}), "worker"), hook) == {1, 2, 3}


def concatenate(hook: str) -> None:
    assert drive(scripted(hook, (["e1"], ["e2", "e3"], [])), hook) == ["e1", "e2", "e3"]


@dataclass
class Events:
    items: list[int]

    def merge(self, other: Events) -> Events:
        return Events(self.items + other.items)


def merge(hook: str) -> None:
    assert drive(scripted(hook, (Events([1]), None, Events([2, 3])), "worker"), hook) == Events(
        [1, 2, 3]
    )
    assert drive(scripted(hook, (None, None, None), "worker"), hook) is None


def hold_any_params_no_clash(hook: str) -> None:
    answers = ((False, {"x": 1}), (True, {"y": 2}), (False, None))
    assert drive(scripted(hook, answers), hook) == (True, {"x": 1, "y": 2})
    assert drive(scripted(hook, ((False, None),) * 3), hook) == (False, None)
    with pytest.raises(TransferParamsClash, match="written by node"):
        drive(scripted(hook, ((False, {"x": 1}), (False, None), (True, {"x": 2}))), hook)
    # kv_composer is everyone's: each node's entries are merged, one level down.
    notes = (
        (False, {"kv_composer": {"retention": {"a": "pin not granted"}}}),
        (False, {"x": 1, "kv_composer": {"retention": {"c": "pin not granted"}, "y": 2}}),
        (False, None),
    )
    merged = {"retention": {"a": "pin not granted", "c": "pin not granted"}, "y": 2}
    assert drive(scripted(hook, notes), hook) == (False, {"kv_composer": merged, "x": 1})


def per_node(hook: str) -> None:
    if hook == "build_connector_meta":
        meta = drive(scripted(hook, ("ma", None, "mc")), hook)
        assert meta.per_node == {"a": "ma", "b": None, "c": "mc"}
    elif hook == "build_connector_worker_meta":
        meta = drive(scripted(hook, (None, Events([1]), None), "worker"), hook)
        assert meta.per_node == {"b": Events([1])}
        assert drive(scripted(hook, (None, None, None), "worker"), hook) is None
    else:
        stats = drive(scripted(hook, ({"moved": 1}, None, {"moved": 2}), "worker"), hook)
        assert {n: e.get("node") for n, e in stats.items()} == {
            "a": {"moved": 1},
            "c": {"moved": 2},
        }


def done_when_all_holders(hook: str) -> None:
    def done(out: Any) -> tuple[set[str], set[str]]:
        if hook == "get_finished":  # vLLM's tuple, None for nothing
            return out[0] or set(), out[1] or set()
        return out.finished_sending, out.finished_recving

    answers = (({"r1"}, {"r2"}), (None, {"r3"}), ({"r1"}, None))
    c = scripted("get_finished", answers, "worker")
    c.bind_connector_metadata(metadata(holds={"r1": ("a", "b")}))
    assert done(drive(c, hook)) == (set(), {"r2", "r3"})
    c.nodes["b"].config.returns["get_finished"] = ({"r1"}, None)
    assert done(drive(c, hook))[0] == {"r1"}  # its last holder, b, is done


CASES: dict[Combine, Callable[[str], None]] = {
    Combine.CALL_EACH: call_each,
    Combine.AT_MOST_ONE: at_most_one,
    Combine.FIRST_NOT_NONE: first_not_none,
    Combine.CHOSEN_NODE: chosen_node,
    Combine.LOAD_POLICY: load_policy,
    Combine.ANY_TRUE: any_true,
    Combine.NOT_ANY_FALSE: not_any_false,
    Combine.ALL_EQUAL: all_equal,
    Combine.UNION: union,
    Combine.CONCATENATE: concatenate,
    Combine.MERGE: merge,
    Combine.HOLD_ANY_PARAMS_NO_CLASH: hold_any_params_no_clash,
    Combine.PER_NODE: per_node,
    Combine.DONE_WHEN_ALL_HOLDERS: done_when_all_holders,
}


def test_every_hook_has_a_rule_and_every_rule_a_case() -> None:
    assert sorted(COMBINE) == spec_hooks()
    assert set(CASES) == set(Combine)


@pytest.mark.parametrize("hook", sorted(COMBINE))
def test_the_chain_combines_as_the_table_says(hook: str) -> None:
    CASES[COMBINE[hook]](hook)


# -- the rest of each hook's row: which nodes it goes to, and when it is timed -- #

HIT = {"get_num_new_matched_tokens": (8, False)}


def _asked_for(hook: str) -> list[str]:
    # Nodes without get_transfer_results are asked get_finished, as vLLM's are.
    return asked("get_finished" if hook == "get_transfer_results" else hook)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_each_hook_goes_to_the_nodes_its_row_names(hook: str) -> None:
    c = chain(
        {n: {"returns": HIT} for n in NODES},
        role_of(hook),
        load_order=["c", "a"],
        save_to=["b", "c"],
    )
    drive(c, hook)
    expected = {
        Nodes.ALL: ["a", "b", "c"],
        Nodes.LOADERS_IN_LOAD_ORDER: ["c", "a"],
        Nodes.LOADERS: ["a", "c"],
        Nodes.SAVERS: ["b", "c"],
    }[HOOKS[hook].nodes]
    if COMBINE[hook] is Combine.CHOSEN_NODE:
        expected = ["c"]  # the first hit in load order serves the request
    assert _asked_for(hook) == expected


@pytest.mark.parametrize("timing", [False, True], ids=["default", "time_hooks"])
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_each_hook_is_timed_as_its_row_says(hook: str, timing: bool) -> None:
    """Per-layer and per-step hooks are timed only when asked (``time_layer_hooks``,
    ``time_step_hooks``); the others always."""
    c = chain(
        {n: {"returns": HIT} for n in NODES},
        role_of(hook),
        time_step_hooks=timing,
        time_layer_hooks=timing,
    )
    out = drive(c, hook)
    name = "get_finished" if hook == "get_transfer_results" else hook
    called = set(_asked_for(hook))
    assert called
    if hook == "get_kv_connector_stats":  # the report took the counters with it
        seen = {n for n, e in (out or {}).items() if name in e["counters"]["hook_seconds"]}
    else:
        seen = {n for n in NODES if name in c.stats[n].hook_seconds}
    always = HOOKS[hook].every not in (Every.STEP, Every.LAYER)
    assert seen == (called if always or timing else set())
