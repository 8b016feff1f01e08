"""``load_policy: ranges`` and per-request tier controls, on plugin fakes (no vLLM).

Each ``holder`` node holds a prompt's first ``holds`` tokens: asked from
``num_computed_tokens`` it offers the rest of them. Blocks are 4 tokens; the
request's blocks are 10..14 (``composer.testing.chains.Blocks``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from composer import Capabilities, Plugin, PluginType, hookimpl, load_pipeline
from composer.chain import ChainMetadata, SchedulerChain, WorkerChain
from composer.controls import controls_of
from composer.testing.chains import (
    HYBRID_KV_CACHE_CONFIG,
    Blocks,
    async_loads,
    connector_output,
    pipeline_chain,
    registry,
    request,
    switched_off,
)
from composer.views import RequestView

#: (node id, hook, argument) of every call a holder received.
CALLS: list[tuple[str, str, Any]] = []
#: Node id -> the async loads its worker half reports done at its next get_finished.
RECVING: dict[str, set[str]] = {}


class HolderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    holds: int = 0
    load_async: bool = False
    fail_in: str | None = None
    #: Worker: the blocks it reports failed.
    bad_blocks: list[int] = []


class Holder(Plugin):
    def _rec(self, hook: str, arg: Any = None) -> None:
        CALLS.append((self.node_id, hook, arg))
        if self.config.fail_in == hook:
            raise RuntimeError(f"{self.node_id} fails in {hook}")

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._rec("get_num_new_matched_tokens", num_computed_tokens)
        hit = max(0, self.config.holds - num_computed_tokens)
        return hit, hit > 0 and self.config.load_async

    @hookimpl
    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        loads = tuple((r.node, r.start, r.tokens) for r in request.loads)
        self._rec("update_state_after_alloc", (num_external_tokens, loads))

    @hookimpl
    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[str, int]:
        return {self.node_id: num_external_tokens}

    @hookimpl
    def start_load_kv(self) -> None:
        self._rec("start_load_kv")

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.config.bad_blocks)

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, RECVING.pop(self.node_id, None)


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(PluginType(name="holder", node=Holder, config=HolderConfig))


class _Module:
    register_plugin_types = staticmethod(register_plugin_types)
    __name__ = "holders"


REGISTRY = registry(_Module())


def chain(holds: dict[str, Any], role: str = "scheduler", **pipeline: Any) -> Any:
    """Holder nodes: id -> tokens held, or a dict of the node's fields and config."""
    nodes = {}
    for node_id, spec in holds.items():
        node = dict(spec) if isinstance(spec, dict) else {"config": {"holds": spec}}
        nodes[node_id] = {"plugin": "holder", **node}
    CALLS.clear()
    RECVING.clear()
    settings = {"load_policy": "ranges", "annotate_outputs": True, **pipeline}
    return pipeline_chain({"nodes": nodes, **settings}, role, types=REGISTRY)


def calls(hook: str) -> list[tuple[str, Any]]:
    return [(n, a) for n, h, a in CALLS if h == hook]


def test_each_node_serves_what_it_holds_after_the_nodes_before_it() -> None:
    c = chain({"fast": 8, "slow": 16, "other": 12})
    assert c.get_num_new_matched_tokens(request(), 0) == (16, False)
    # Each node is asked from where the ranges before it end.
    assert calls("get_num_new_matched_tokens") == [("fast", 0), ("slow", 8), ("other", 16)]
    c.update_state_after_alloc(request(), Blocks(), 16)
    loads = (("fast", 0, 8), ("slow", 8, 8))
    assert calls("update_state_after_alloc") == [
        ("fast", (8, loads)),
        ("slow", (8, loads)),
        ("other", (0, loads)),
    ]
    meta = c.build_connector_meta(SimpleNamespace())
    assert meta.loads == {"fast": {10, 11}, "slow": {12, 13}}  # each its own range's blocks
    assert meta.async_loads is None  # every range sync: vLLM's sync protocol
    _, params = c.request_finished(request(), [])
    assert params == {
        "kv_composer": {
            "served_by": "fast+slow",
            "tokens": 16,
            "ranges": [
                {"node": "fast", "start": 0, "tokens": 8},
                {"node": "slow", "start": 8, "tokens": 8},
            ],
        }
    }
    assert (c.stats["fast"].tokens_hit, c.stats["slow"].tokens_hit) == (8, 8)
    assert c.stats["other"].hits == 0 and c.stats["other"].lookups == 1


def test_ranges_follow_load_order_and_start_at_vllms_computed_tokens() -> None:
    c = chain({"fast": 8, "slow": 16}, load_order=["slow", "fast"])
    assert c.get_num_new_matched_tokens(request(), 4) == (12, False)
    assert calls("get_num_new_matched_tokens") == [("slow", 4), ("fast", 16)]
    c.update_state_after_alloc(request(), Blocks(), 12)
    assert c.build_connector_meta(SimpleNamespace()).loads == {"slow": {11, 12, 13}}


@pytest.mark.parametrize("policy", ["first_hit", "longest_hit"])
def test_one_node_policies_load_from_one_node(policy: str) -> None:
    c = chain({"fast": 8, "slow": 16}, load_policy=policy)
    expected = 8 if policy == "first_hit" else 16
    assert c.get_num_new_matched_tokens(request(), 0) == (expected, False)
    assert all(arg == 0 for _, arg in calls("get_num_new_matched_tokens"))


def test_vllm_taking_fewer_tokens_cuts_the_last_ranges() -> None:
    c = chain({"a": 4, "b": 8, "c": 16})
    assert c.get_num_new_matched_tokens(request(), 0) == (16, False)
    c.update_state_after_alloc(request(), Blocks(), 6)  # (never more than offered)
    assert [a[0] for _, a in calls("update_state_after_alloc")] == [4, 2, 0]


#: What vLLM reports back -> tokens that arrived from fast [0, 8) and slow [8, 16).
#: vLLM recomputes from the first failed block on, so a failure in the first
#: range loses the second as well.
OUTCOMES = {
    "both arrived": ({}, 8, 8),
    "slow's second block failed": ({"invalid": {13}}, 8, 4),
    "slow's first block failed": ({"invalid": {12}}, 8, 0),
    "fast's second block failed": ({"invalid": {11}}, 4, 0),
    "fast's first block failed": ({"invalid": {10}}, 0, 0),
    "the request's load failed": ({"failed": {"r1"}}, 0, 0),
    "another request's": ({"invalid": {20}, "failed": {"r2"}}, 8, 8),
}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_each_range_is_settled_by_what_arrived(outcome: str) -> None:
    report, fast, slow = OUTCOMES[outcome]
    c = chain({"fast": 8, "slow": 16})
    c.get_num_new_matched_tokens(request(), 0)
    c.update_state_after_alloc(request(), Blocks(), 16)
    c.build_connector_meta(SimpleNamespace())
    c.update_connector_output(connector_output(**report))
    _, params = c.request_finished(request(), [])
    assert params is not None
    note = params["kv_composer"]
    assert note["ranges"] == [
        {"node": "fast", "start": 0, "tokens": fast},
        {"node": "slow", "start": 8, "tokens": slow},
    ]
    assert note["tokens"] == fast + slow
    assert note["served_by"] == (
        "+".join(n for n, t in (("fast", fast), ("slow", slow)) if t) or None
    )
    failed = [{"node": n, "tokens": 8 - t} for n, t in (("fast", fast), ("slow", slow)) if t < 8]
    assert note.get("failed", []) == failed
    for node_id, delivered in (("fast", fast), ("slow", slow)):
        stats = c.stats[node_id]
        assert (stats.tokens_hit, stats.requests_hit) == (delivered, int(delivered > 0))
        assert stats.extra.get("tokens_load_failed", 0) == 8 - delivered


def test_async_and_sync_ranges_make_one_async_load_done_when_every_range_is() -> None:
    nodes = {
        "fast": {"config": {"holds": 8}},
        "slow": {"config": {"holds": 16, "load_async": True}},
    }
    sched = chain(nodes)
    assert sched.get_num_new_matched_tokens(request(), 0) == (16, True)
    sched.update_state_after_alloc(request(), Blocks(), 16)
    meta = sched.build_connector_meta(SimpleNamespace())
    assert async_loads(meta) == {
        "r1": (("fast", frozenset({10, 11}), True), ("slow", frozenset({12, 13}), False))
    }
    worker = chain(nodes, role="worker")
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    # fast's sync range is done; slow is still loading: not finished for vLLM yet,
    # and finished once slow alone says so (nothing of fast's is pending).
    assert worker.get_transfer_results(set()).finished_recving == set()
    done = _report(worker, "slow", {"r1"})
    assert (done.finished_recving, done.failed_recving) == ({"r1"}, set())


def _report(worker: WorkerChain, node_id: str, recving: set[str]) -> Any:
    """``node_id``'s worker reports ``recving`` finished in this step (its
    ``get_finished``); what the chain's ``get_transfer_results`` tells vLLM."""
    RECVING[node_id] = recving
    return worker.get_transfer_results(set())


@pytest.mark.parametrize("policy", ["recompute", "disable"])
@pytest.mark.parametrize("failing", ["fast", "slow"])
def test_a_failing_node_of_a_ranged_sync_load_loses_only_its_blocks(
    failing: str, policy: str
) -> None:
    nodes = {
        "fast": {"on_error": policy, "config": {"holds": 8}},
        "slow": {"on_error": policy, "config": {"holds": 16}},
    }
    nodes[failing]["config"]["fail_in"] = "start_load_kv"
    sched = chain(nodes)
    sched.get_num_new_matched_tokens(request(), 0)
    sched.update_state_after_alloc(request(), Blocks(), 16)
    meta = sched.build_connector_meta(SimpleNamespace())
    worker = chain(nodes, role="worker")
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    errors = worker.get_block_ids_with_load_errors()
    assert errors == ({10, 11} if failing == "fast" else {12, 13})
    assert (failing in switched_off(worker.take_stats())) == (policy == "disable")
    # Both nodes ran their loads: one's failure does not stop the other's.
    assert {n for n, _ in calls("start_load_kv")} == {"fast", "slow"}
    sched.update_connector_output(connector_output(invalid=errors))
    note = sched.request_finished(request(), [])[1]["kv_composer"]  # type: ignore[index]
    assert note["tokens"] == (0 if failing == "fast" else 8)


@pytest.mark.parametrize("failing", ["fast", "slow"])
def test_a_node_switched_off_during_a_ranged_async_load_fails_the_request_once_all_are_done(
    failing: str,
) -> None:
    nodes = {
        name: {"on_error": "disable", "config": {"holds": holds, "load_async": True}}
        for name, holds in (("fast", 8), ("slow", 16))
    }
    nodes[failing]["config"]["fail_in"] = "start_load_kv"
    sched = chain(nodes)
    assert sched.get_num_new_matched_tokens(request(), 0) == (16, True)
    sched.update_state_after_alloc(request(), Blocks(), 16)
    worker = chain(nodes, role="worker")
    worker.bind_connector_metadata(sched.build_connector_meta(SimpleNamespace()))
    worker.start_load_kv(None)
    assert switched_off(worker.take_stats()) == {failing}
    # The other node may still write into the request's blocks: not reported yet.
    first = worker.get_transfer_results(set())
    assert "r1" not in first.finished_recving
    other = "slow" if failing == "fast" else "fast"
    done = _report(worker, other, {"r1"})
    assert (done.finished_recving, done.failed_recving) == ({"r1"}, {"r1"})
    sched.update_connector_output(connector_output(failed={"r1"}))
    note = sched.request_finished(request(), [])[1]["kv_composer"]  # type: ignore[index]
    assert note["tokens"] == 0 and note["served_by"] is None


#: Block 0 is vLLM's null block: the window has left those positions.
HYBRID_BLOCKS = ([0, 0, 22, 23, 24], [10, 11, 12, 13, 14])


@pytest.mark.parametrize("failing", [None, "fast", "slow"])
def test_several_kv_cache_groups_ranges_load_as_one_request(failing: str | None) -> None:
    nodes: dict[str, Any] = {
        "fast": {"on_error": "recompute", "config": {"holds": 8}},
        "slow": {"on_error": "recompute", "config": {"holds": 16, "load_async": True}},
    }
    if failing:
        nodes[failing]["config"]["bad_blocks"] = [12 if failing == "slow" else 11]
    types = registry(_Module(), _HybridModule())
    for node in nodes.values():
        node["plugin"] = "hybrid-holder"
    pipeline = {"version": 1, "nodes": nodes, "load_policy": "ranges", "hma": "on"}
    resolved = load_pipeline(pipeline, registry=types)
    sched = SchedulerChain(resolved, kv_cache_config=HYBRID_KV_CACHE_CONFIG)
    assert sched.get_num_new_matched_tokens(request(), 0) == (16, True)
    sched.update_state_after_alloc(request(), Blocks(*HYBRID_BLOCKS), 16)
    meta = sched.build_connector_meta(SimpleNamespace())
    # Each range's blocks in both groups, never the null block.
    assert meta.loads == {"fast": {10, 11}, "slow": {22, 23, 12, 13}}
    worker = WorkerChain(resolved, kv_cache_config=HYBRID_KV_CACHE_CONFIG)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    first = worker.get_transfer_results(set())
    assert first.finished_recving == set()  # slow (async) has not finished
    done = _report(worker, "slow", {"r1"})
    assert done.finished_recving == {"r1"}
    # vLLM takes no block ids with several groups: a lost block fails the request.
    assert done.failed_recving == ({"r1"} if failing else set())
    assert worker.get_block_ids_with_load_errors() == set()
    sched.update_connector_output(connector_output(failed=set(done.failed_recving)))
    note = sched.request_finished_all_groups(request(), ([], []))[1]
    assert note is None  # (annotate_outputs is off here)


class _HybridModule:
    __name__ = "hybrid-holders"

    @staticmethod
    @hookimpl
    def register_plugin_types(register: Any) -> None:
        register(
            PluginType(
                name="hybrid-holder",
                node=Holder,
                config=HolderConfig,
                capabilities=Capabilities(hma=True),
            )
        )


def test_hit_sources_are_asked_of_each_range_and_summed() -> None:
    c = chain({"fast": 8, "slow": 16})
    c.get_num_new_matched_tokens(request(), 0)
    assert c.get_external_cache_hit_sources(request(), 16) == {"fast": 8, "slow": 8}


def _with_params(params: dict[str, Any]) -> Any:
    req = request()
    req.kv_transfer_params = params
    return req


@pytest.mark.parametrize("policy", ["first_hit", "longest_hit", "ranges"])
def test_kv_load_tiers_restricts_the_nodes_a_request_loads_from(policy: str) -> None:
    c = chain({"fast": 8, "slow": 16}, load_policy=policy)
    assert c.get_num_new_matched_tokens(_with_params({"kv_load_tiers": ["slow"]}), 0) == (
        16,
        False,
    )
    # Every node is still asked (vLLM's API: a lookup before update_state_after_alloc).
    assert calls("get_num_new_matched_tokens") == [("fast", 0), ("slow", 0)]
    assert c.stats["fast"].hits == 0 and c.stats["slow"].hits == 1
    c.update_state_after_alloc(_with_params({"kv_load_tiers": ["slow"]}), Blocks(), 16)
    assert [a[0] for _, a in calls("update_state_after_alloc")] == [0, 16]
    assert c.get_num_new_matched_tokens(_with_params({"kv_load_tiers": []}), 0) == (0, False)


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"kv_load_tiers": ["fsat"]}, "kv_load_tiers: unknown node(s) 'fsat'"),
        ({"kv_load_tiers": "fast"}, "kv_load_tiers: expected a list of node ids"),
        ({"kv_store_tiers": [1]}, "kv_store_tiers: expected a list of node ids"),
        ({"max_offload_tokens": -1}, "max_offload_tokens: expected a whole number >= 0"),
        ({"max_offload_tokens": True}, "max_offload_tokens: expected a whole number >= 0"),
        ({"max_offload_tokens": "10"}, "max_offload_tokens: expected a whole number >= 0"),
    ],
)
def test_bad_controls_load_nothing_and_say_why_in_the_response(
    params: dict[str, Any], error: str
) -> None:
    c = chain({"fast": 8, "slow": 16}, annotate_outputs=False)
    req = _with_params(params)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params == params  # untouched
    _, out = c.request_finished(req, [])
    assert out is not None and error in out["kv_composer"]["error"]
    if "unknown" not in error:  # malformed: nothing is saved either
        assert RequestView(req).store_limit("fast") == 0


def test_a_misspelled_store_tier_matches_no_node_and_is_reported() -> None:
    c = chain({"fast": 8, "slow": 16}, annotate_outputs=False)
    req = _with_params({"kv_store_tiers": ["fast", "sloww"]})
    assert c.get_num_new_matched_tokens(req, 0) == (16, False)  # loads are not restricted
    view = RequestView(req)
    assert (view.store_limit("fast"), view.store_limit("slow")) == (None, 0)
    _, out = c.request_finished(req, [])
    assert out is not None
    assert (
        "kv_store_tiers: unknown node(s) 'sloww', which match no node"
        in (out["kv_composer"]["error"])
    )


@pytest.mark.parametrize(
    ("params", "limits"),
    [
        ({}, (None, None)),
        ({"other": 1}, (None, None)),
        ({"kv_store_tiers": ["fast"]}, (None, 0)),
        ({"kv_store_tiers": []}, (0, 0)),
        ({"max_offload_tokens": 64}, (64, 64)),
        ({"kv_store_tiers": ["slow"], "max_offload_tokens": 0}, (0, 0)),
        ({"kv_store_tiers": ["slow"], "max_offload_tokens": 32}, (0, 32)),
    ],
)
def test_store_limit_per_node(params: dict[str, Any], limits: tuple[Any, Any]) -> None:
    controls = controls_of(params)
    assert (controls.store_limit("fast"), controls.store_limit("slow")) == limits


def test_metadata_default_has_no_async_loads() -> None:
    assert ChainMetadata().async_loads is None
