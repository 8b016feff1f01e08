"""Every hook x every ``on_error`` policy, in the chain (no vLLM needed).

The engine-level matrix (``tests/e2e/test_fault_matrix.py``) proves tokens,
blocks and shutdown on real vLLM for the hooks vLLM calls on CPU; here every
hook of the spec is failed once, in each vLLM process that calls it, and what the chain
does is checked exactly: who is switched off, what becomes a load error, what
is released, what is counted and logged.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from structlog.testing import capture_logs

from composer import Capabilities, PluginType, Unavailable, hookimpl
from composer.chain import ChainCore
from composer.chain.faults import NodeFailed, WorkerLedger
from composer.hook_table import HOOKS, Away, Recompute, hooks_where
from composer.hookspecs import STORE_CALLS
from composer.testing.chains import (
    NOTHING,
    Blocks,
    Scripted,
    async_load,
    drive,
    pipeline_chain,
    processes_of,
    registry,
    request,
    spec_hooks,
    switched_off,
)

#: The hooks whose failure under recompute turns the step's loads into load errors.
LOAD_HOOKS = frozenset(hooks_where(recompute=Recompute.BLOCKS_RECOMPUTED))
#: Under ``recompute`` a failure here costs only that call's effect: the node stays on.
RECOVERABLE_HOOKS = frozenset(n for n, h in HOOKS.items() if h.recompute != Recompute.SWITCH_OFF)
#: A node's ``Unavailable`` here is an outage, not a fault.
AWAY_HOOKS = frozenset(n for n, h in HOOKS.items() if h.away != Away.FAULT)

SHUTDOWNS: list[str] = []
#: Node id -> the finished requests its worker half reports sent at its next get_finished.
SENT: dict[str, set[str]] = {}


class FaultConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail_in: str = ""
    hit: int = 0
    load_async: bool = False
    hold: bool = False
    #: Raise Unavailable (the node's store is away) instead of a fault.
    away: bool = False


class Everything(Scripted):
    """Implements every hook of the spec (``Scripted``'s); raises in ``fail_in``."""

    def answer(self, hook: str) -> Any:
        if self.config.fail_in == hook:
            if self.config.away:
                raise Unavailable(f"store away in {hook}")
            raise RuntimeError(f"boom in {hook}")
        if hook == "shutdown":
            SHUTDOWNS.append(self.node_id)
        if hook == "take_events" and self.node_id in SHUTDOWNS:
            # A tier's last word: everything it held is gone.
            return [SimpleNamespace(ownership=None, kind="removed")]
        if hook == "get_finished":
            return SENT.pop(self.node_id, None), None
        if hook == "get_num_new_matched_tokens":
            return self.config.hit, self.config.load_async
        if hook in ("request_finished", "request_finished_all_groups"):
            return self.config.hold, None
        return NOTHING.get(hook)


# Without get_transfer_results, whose nodes the chain asks instead of get_finished.
ALL_HOOKS = [h for h in spec_hooks() if h != "get_transfer_results"]


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="everything",
            node=Everything,
            config=FaultConfig,
            capabilities=Capabilities(hma=True),  # so request_finished_all_groups is called
        )
    )


class _Module:
    register_plugin_types = staticmethod(register_plugin_types)
    __name__ = "fault_fakes"


REGISTRY = registry(_Module())


def _chain(role: Any, policy: str, fail_in: str = "", **config: Any) -> Any:
    SHUTDOWNS.clear()
    SENT.clear()
    nodes = {
        "bad": {
            "plugin": "everything",
            "on_error": policy,
            "config": {"fail_in": fail_in, "hit": 4, **config},
        },
        "good": {"plugin": "everything", "config": {"hold": config.get("hold", False)}},
    }
    return pipeline_chain({"nodes": nodes}, role, types=REGISTRY)


def _report(chain: ChainCore, hook: str, out: Any) -> dict[str, Any]:
    """The chain's stats report after ``hook`` answered ``out``: ``out`` itself when
    the hook is vLLM's ``get_kv_connector_stats`` (the report takes the counters)."""
    return out if hook == "get_kv_connector_stats" else chain.take_stats()


def _meta(chain: ChainCore, **fields: Any) -> Any:
    from composer.chain import ChainMetadata

    return ChainMetadata(per_node={}, loads={"bad": {10, 11}}, **fields)


def test_every_spec_hook_is_driven() -> None:
    """A hook added to the spec without a case here fails this test."""
    chains = {role: _chain(role, "recompute") for role in ("scheduler", "worker")}
    for hook in ALL_HOOKS:
        for role in processes_of(hook):
            drive(chains[role], hook, request())


@pytest.mark.parametrize("hook", ALL_HOOKS)
def test_fail_stops_with_the_node_hook_and_plugin_named(hook: str) -> None:
    for role in processes_of(hook):
        chain = _chain(role, "fail", hook)
        if not chain.implemented(hook):
            continue
        with pytest.raises((NodeFailed, RuntimeError)) as raised:
            drive(chain, hook, request())
        if hook != "shutdown":  # shutdown re-raises the node's own error after the others ran
            assert isinstance(raised.value, NodeFailed)
            assert f'node "bad" (plugin everything) failed in {hook}' in str(raised.value)


@pytest.mark.parametrize("hook", ALL_HOOKS)
@pytest.mark.parametrize("policy", ["recompute", "disable"])
def test_recompute_keeps_the_node_only_where_recompute_undoes_the_fault(
    hook: str, policy: str
) -> None:
    for role in processes_of(hook):
        chain = _chain(role, policy, hook)
        if not chain.implemented(hook):
            continue
        if role == "worker" and hook in LOAD_HOOKS:
            chain.bind_connector_metadata(_meta(chain))
        out = drive(chain, hook, request())  # never raises
        report = _report(chain, hook, out)
        counted = report["bad"]["counters"]
        assert counted["errors"] == 1 and counted["extra"][f"errors_{hook}"] == 1
        stays = policy == "recompute" and hook in RECOVERABLE_HOOKS or hook == "shutdown"
        assert switched_off(report) == (set() if stays else {"bad"}), (role, hook)
        if not stays:
            assert SHUTDOWNS == ["bad"], "a switched-off node's shutdown stops its transfers"
            assert chain.implemented(hook) in ([], ["good"])
        if role == "worker" and hook in LOAD_HOOKS:
            # The blocks it was loading this step are recomputed, whatever the policy.
            assert chain.get_block_ids_with_load_errors() == {10, 11}


@pytest.mark.parametrize("hook", ALL_HOOKS)
@pytest.mark.parametrize("policy", ["fail", "recompute", "disable"])
def test_a_store_away_is_no_fault_where_the_hook_can_say_so(hook: str, policy: str) -> None:
    """Unavailable under every policy: the node stays on and the call's effect is
    what the hook's ``away`` says; where it says "a fault", the policy applies."""
    for role in processes_of(hook):
        chain = _chain(role, policy, hook, away=True, hold=True, load_async=True)
        if not chain.implemented(hook):
            continue
        if role == "worker" and hook in LOAD_HOOKS:
            chain.bind_connector_metadata(
                _meta(chain, async_loads={"r0": (async_load("bad", {1}),)})
            )
        if hook not in AWAY_HOOKS:
            if policy == "fail":
                # (shutdown re-raises the node's own error after the others ran)
                with pytest.raises(Unavailable if hook == "shutdown" else NodeFailed):
                    drive(chain, hook, request())
            else:
                out = drive(chain, hook, request())
                assert _report(chain, hook, out)["bad"]["counters"]["errors"] == 1
            continue
        with capture_logs() as logs:
            out = drive(chain, hook, request())  # never raises, whatever the policy
        report = _report(chain, hook, out)
        counted = report["bad"]["counters"]
        assert counted["errors"] == 0 and counted["unavailable"] == {hook: 1}, (role, hook)
        assert switched_off(report) == set() and SHUTDOWNS == []
        assert counted["extra"]["outages"] == 1 and counted["gauges"]["store_away"] == 1
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
            "node's store is away: the node stays on, vLLM recomputes what it would "
            "have served or saved until it is back"
        ]
        away = HOOKS[hook].away
        if away is Away.MISS:
            assert out == (0, False), "the other node has no hit; the away one is a miss"
        if away is Away.SAVE_SKIPPED and hook.startswith("request_finished"):
            meta = chain.build_connector_meta(SimpleNamespace())
            assert meta.holds == {"r1": ("good",)}, "nothing held for the away node"
        if role == "worker" and away is Away.BLOCKS_RECOMPUTED:
            # Even with an async load of it in flight: the node reports that one itself.
            assert chain.get_block_ids_with_load_errors() == {10, 11}


@pytest.mark.parametrize("hook", STORE_CALLS)
def test_an_outage_is_logged_once_and_ends_at_the_next_store_call_that_returns(
    hook: str,
) -> None:
    role = "scheduler" if HOOKS[hook].process == "scheduler" else "worker"
    chain = _chain(role, "fail", hook, away=True)
    with capture_logs() as logs:
        for _ in range(3):
            drive(chain, hook, request())
        counted = chain.take_stats()["bad"]["counters"]
        assert counted["unavailable"] == {hook: 3} and counted["extra"]["outages"] == 1
        assert counted["gauges"]["store_away"] == 1
        chain.nodes["bad"].config.fail_in = ""  # the store is back
        drive(chain, hook, request())
        drive(chain, hook, request())
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings][1:] == ["node's store is back"]
    assert warnings[1]["calls_unavailable"] == 3 and warnings[1]["away_s"] >= 0
    counted = chain.take_stats()["bad"]["counters"]
    assert counted["unavailable"] == {} and counted["gauges"]["store_away"] == 0
    # The outage is over: the store going away again is a new one.
    chain.nodes["bad"].config.fail_in = hook
    drive(chain, hook, request())
    counted = chain.take_stats()["bad"]["counters"]
    assert counted["extra"]["outages"] == 1 and counted["gauges"]["store_away"] == 1


def test_scheduler_switch_off_reaches_the_worker_releasing_holds_and_failing_async_loads() -> None:
    sched = _chain("scheduler", "recompute", "request_finished", hit=8, load_async=True, hold=True)
    worker = _chain("worker", "recompute", "", hold=True)
    # r0 is loading asynchronously through "bad"; r1 finishes while "bad" fails.
    assert sched.get_num_new_matched_tokens(request("r0"), 0) == (8, True)
    sched.update_state_after_alloc(request("r0"), Blocks(), 8)
    worker.bind_connector_metadata(sched.build_connector_meta(SimpleNamespace()))
    worker.clear_connector_metadata()
    hold, _ = sched.request_finished(request("r1"), [10, 11])
    assert hold and switched_off(sched.take_stats()) == {"bad"}
    meta = sched.build_connector_meta(SimpleNamespace())
    assert meta.disabled == {"bad"} and meta.holds == {"r1": ("bad", "good")}
    worker.bind_connector_metadata(meta)
    assert switched_off(worker.take_stats()) == {"bad"}
    assert SHUTDOWNS == ["bad", "bad"]  # both halves
    results = worker.get_transfer_results(set())
    # r0 can never finish loading through "bad": vLLM recomputes it.
    assert results.finished_recving == {"r0"} and results.failed_recving == {"r0"}
    # r1 is still held by "good"; "bad" let go of it.
    assert results.finished_sending == set()
    SENT["good"] = {"r1"}  # its last holder is done: vLLM may free r1's blocks
    assert worker.get_transfer_results(set()).finished_sending == {"r1"}


def test_a_switched_off_nodes_last_events_are_published_with_the_next_step() -> None:
    sched = _chain("scheduler", "disable", "request_finished")
    assert list(sched.take_events()) == []
    sched.request_finished(request("r1"), [10])
    assert switched_off(sched.take_stats()) == {"bad"} and SHUTDOWNS == ["bad"]
    events = list(sched.take_events())
    assert [(e.ownership, e.kind) for e in events] == [("bad", "removed")]
    assert list(sched.take_events()) == [], "published once"


def test_worker_switch_off_reaches_the_scheduler() -> None:
    sched = _chain("scheduler", "disable", "", hit=8)
    worker = _chain("worker", "disable", "wait_for_save")
    worker.wait_for_save()
    assert switched_off(worker.take_stats()) == {"bad"}
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.disabled == {"bad"}
    assert worker.build_connector_worker_meta() is None  # told once
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    assert switched_off(sched.take_stats()) == {"bad"} and SHUTDOWNS == ["bad", "bad"]
    # The scheduler half no longer claims hits for a node that cannot load them.
    assert sched.get_num_new_matched_tokens(request(), 0) == (0, False)


def test_async_load_fault_under_recompute_switches_the_node_off() -> None:
    """A failed async load may still be writing into vLLM's blocks: the node's
    shutdown must stop it before vLLM recomputes into them."""
    worker = _chain("worker", "recompute", "start_load_kv")
    worker.bind_connector_metadata(_meta(worker, async_loads={"r0": (async_load("bad", {1}),)}))
    worker.start_load_kv(None)
    assert switched_off(worker.take_stats()) == {"bad"} and SHUTDOWNS == ["bad"]
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"r0"} == results.failed_recving


def test_ledger_frees_a_request_when_its_last_holder_finishes_or_is_switched_off() -> None:
    ledger = WorkerLedger()
    ledger.hold("r1", ["a", "b"])
    assert ledger.sent("a", {"r1"}) == set()
    assert ledger.sent("c", {"r1"}) == set()  # not a holder: no effect
    assert ledger.sent("b", {"r1"}) == {"r1"}
    assert ledger.sent("a", {"r2"}) == {"r2"}  # never held: passed on (MultiConnector)
    ledger.hold("r3", ["a", "b"])
    ledger.hold("r4", ["b"])
    assert ledger.release("b") == {"r4"}
    assert ledger.sent("a", {"r3"}) == {"r3"}
    assert ledger.held() == 0
    ledger.loading("r5", ["a"], frozenset({1}))
    assert ledger.received("a", {"r5"}) == ({"r5"}, set())
    assert not ledger.has_async_loads("a")
    ledger.loading("r6", ["a"], frozenset({1}))
    assert ledger.drop_loads("a") == ({"r6"}, {"r6"})
    # A request loading ranges from two nodes is done when both are, failed if one failed.
    ledger.loading("r7", ["a", "b"], frozenset({1, 2}))
    assert ledger.received("a", {"r7"}) == (set(), set())
    assert ledger.has_async_loads("b")
    assert ledger.received("b", {"r7"}) == ({"r7"}, set())
    ledger.loading("r8", ["a", "b"], frozenset({1, 2}), sync=["a"])
    assert not ledger.has_async_loads("a")  # its sync range writes nothing later
    ledger.fail_blocks({2})
    assert ledger.drop_loads("b") == (set(), set())  # a's range still pending
    assert ledger.received("a", {"r8"}) == ({"r8"}, {"r8"})
    assert ledger.received("a", {"r9"}) == ({"r9"}, set())  # unknown: passed on
