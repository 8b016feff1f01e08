"""The chain's MultiConnector semantics, on plugin fakes (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pluggy
import pytest
from pydantic import BaseModel, ConfigDict

from composer import Capabilities, Plugin, PluginType, discover, hookimpl, load_pipeline
from composer.chain import SchedulerChain, TransferParamsClash, WorkerChain
from composer.testing.chains import (
    HYBRID_KV_CACHE_CONFIG,
    KV_CACHE_CONFIG,
    Blocks,
    async_loads,
    connector_output,
    pipeline_chain,
    registry,
    request,
    switched_off,
)

CALLS: list[tuple[str, str, Any]] = []


class FakeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hit: int | None = 0
    hold: bool = False
    params: dict[str, Any] | None = None
    fail_in: str | None = None


class Tier(Plugin):
    """Records calls; answers from its config."""

    def _rec(self, hook: str, arg: Any = None) -> None:
        CALLS.append((self.node_id, hook, arg))
        if self.config.fail_in == hook:
            raise RuntimeError(f"{self.node_id} fails in {hook}")

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._rec("get_num_new_matched_tokens")
        return self.config.hit, False

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: Any, num_external_tokens: int
    ) -> None:
        self._rec("update_state_after_alloc", num_external_tokens)

    @hookimpl
    def build_connector_meta(self, step: Any) -> str:
        return f"meta-{self.node_id}"

    @hookimpl
    def bind_connector_metadata(self, metadata: Any) -> None:
        self._rec("bind_connector_metadata", metadata)

    @hookimpl
    def start_load_kv(self, forward_context: Any) -> None:
        self._rec("start_load_kv")

    @hookimpl
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._rec("request_finished")
        return self.config.hold, self.config.params

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return ({"r1"} if self.config.hold else None), None


class Saver(Tier):
    @hookimpl
    def save_kv_layer(self, layer_name: str) -> None:
        self._rec("save_kv_layer", layer_name)


class Misspelled(Plugin):
    @hookimpl
    def start_lod_kv(self) -> None:  # a typo: must not be silently ignored
        pass


class Ordered(Plugin):
    @hookimpl(tryfirst=True)
    def on_new_request(self, request: Any) -> None:
        pass


class Wrapping(Plugin):
    @hookimpl(wrapper=True)
    def wait_for_save(self) -> Any:
        return (yield)


class Viewer(Plugin):
    """Keeps the request views it is handed, and reads their controls."""

    seen: list[tuple[str, Any]] = []

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self.seen.append(("lookup", request))
        return 8, False

    @hookimpl
    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        self.seen.append(("alloc", request))

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self.seen.append(("finished", request))
        return False, None


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(PluginType(name="tier", node=Tier, config=FakeConfig))
    register(PluginType(name="viewer", node=Viewer))
    register(PluginType(name="saver", node=Saver, config=FakeConfig))
    register(
        PluginType(
            name="hybrid-tier", node=Tier, config=FakeConfig, capabilities=Capabilities(hma=True)
        )
    )
    register(PluginType(name="misspelled", node=Misspelled, capabilities=Capabilities()))
    register(PluginType(name="ordered", node=Ordered))
    register(PluginType(name="wrapping", node=Wrapping))


class _Module:
    register_plugin_types = staticmethod(register_plugin_types)
    __name__ = "fakes"


REGISTRY = registry(_Module())


def chain(nodes: dict[str, Any], role: str = "scheduler", **pipeline: Any) -> Any:
    CALLS.clear()
    return pipeline_chain({"nodes": nodes, **pipeline}, role, types=REGISTRY)


def test_first_hit_serves_and_others_get_zero_tokens() -> None:
    c = chain(
        {
            "a": {"plugin": "tier", "config": {"hit": 0}},
            "b": {"plugin": "tier", "config": {"hit": 8}},
            "c": {"plugin": "tier", "config": {"hit": 12}},
        }
    )
    assert c.get_num_new_matched_tokens(request(), 0) == (8, False)
    c.update_state_after_alloc(request(), Blocks(), 8)
    assert [(n, a) for n, h, a in CALLS if h == "update_state_after_alloc"] == [
        ("a", 0),
        ("b", 8),
        ("c", 0),
    ]
    assert c.stats["b"].hits == 1 and c.stats["a"].lookups == 1


def test_a_request_counts_once_per_node_however_often_vllm_asks() -> None:
    c = chain(
        {
            "a": {"plugin": "tier", "config": {"hit": 0}},
            "b": {"plugin": "tier", "config": {"hit": 8}},
        }
    )
    # vLLM asks again while it cannot schedule the request, then admits it once.
    for _ in range(3):
        assert c.get_num_new_matched_tokens(request(), 0) == (8, False)
    c.update_state_after_alloc(request(), Blocks(), 8)
    # Back after a preemption: asked and admitted again, counted by vLLM apart.
    back = request()
    back.num_preemptions = 1
    c.get_num_new_matched_tokens(back, 0)
    c.update_state_after_alloc(back, Blocks(), 8)
    c.request_finished(back, [])  # what it served is counted once settled
    counted = {
        n: (
            s.lookups,
            s.requests_looked_up,
            s.requests_hit,
            s.prompt_tokens_looked_up,
            s.prompt_tokens_hit,
        )
        for n, s in c.stats.items()
    }
    assert counted == {"a": (4, 1, 0, 20, 0), "b": (4, 1, 1, 20, 8)}


#: (what vLLM reports back, the request's computed tokens at lookup, tokens delivered).
#: Blocks of 4 tokens; the node loads 8 tokens into blocks 10, 11 (11, 12 from 4 computed).
OUTCOMES = {
    "arrived": ({}, 0, 8),
    "second block failed": ({"invalid": {11}}, 0, 4),
    "first block failed": ({"invalid": {10}}, 0, 0),
    "both failed": ({"invalid": {10, 11}}, 0, 0),
    "another request's block": ({"invalid": {13}}, 0, 8),
    "async load failed": ({"failed": {"r1"}}, 0, 0),
    "another request's async load": ({"failed": {"r2"}}, 0, 8),
    "after computed tokens": ({"invalid": {12}}, 4, 4),
}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_what_a_node_served_is_what_arrived(outcome: str) -> None:
    report, computed, delivered = OUTCOMES[outcome]
    c = chain(
        {
            "a": {"plugin": "tier", "config": {"hit": 0}},
            "b": {"plugin": "tier", "config": {"hit": 8}},
        },
        annotate_outputs=True,
    )
    assert c.get_num_new_matched_tokens(request(), computed) == (8, False)
    c.update_state_after_alloc(request(), Blocks(), 8)
    c.build_connector_meta(None)
    c.update_connector_output(connector_output(**report))
    _, params = c.request_finished(request(), [])
    assert params is not None
    note = params["kv_composer"]
    assert note["tokens"] == delivered
    assert note["served_by"] == ("b" if delivered else None)
    assert note.get("failed") == (
        None if delivered == 8 else {"node": "b", "tokens": 8 - delivered}
    )
    b = c.stats["b"]
    assert (b.tokens_hit, b.requests_hit, b.prompt_tokens_hit) == (
        delivered,
        int(delivered > 0),
        delivered,
    )
    assert b.extra.get("tokens_load_failed", 0) == 8 - delivered
    assert b.extra.get("loads_failed", 0) == int(delivered < 8)
    assert c.stats["a"].tokens_hit == 0 and c.stats["a"].requests_hit == 0


def test_longest_hit_policy_and_load_order() -> None:
    c = chain(
        {
            "a": {"plugin": "tier", "config": {"hit": 8}},
            "b": {"plugin": "tier", "config": {"hit": 12}},
            "c": {"plugin": "tier", "config": {"hit": 12}},
        },
        load_policy="longest_hit",
        load_order=["c", "b", "a"],
    )
    assert c.get_num_new_matched_tokens(request(), 0) == (12, False)
    assert [n for n, h, _ in CALLS if h == "get_num_new_matched_tokens"] == ["c", "b", "a"]
    c.update_state_after_alloc(request(), Blocks(), 12)
    # Ties go to the earlier node in load order: c loads the 12 tokens.
    assert [(n, a) for n, h, a in CALLS if h == "update_state_after_alloc"] == [
        ("a", 0),
        ("b", 0),
        ("c", 12),
    ]


def test_none_means_still_looking_up_and_stops_the_round() -> None:
    c = chain(
        {
            "a": {"plugin": "tier", "config": {"hit": None}},
            "b": {"plugin": "tier", "config": {"hit": 4}},
        }
    )
    assert c.get_num_new_matched_tokens(request(), 0) == (None, False)
    assert [n for n, h, _ in CALLS if h == "get_num_new_matched_tokens"] == ["a"]


def test_blocks_held_until_every_async_saver_is_done() -> None:
    sched = chain(
        {
            "a": {"plugin": "tier", "config": {"hold": True}},
            "b": {"plugin": "tier", "config": {"hold": True}},
        }
    )
    assert sched.request_finished(request(), [1, 2]) == (True, None)
    meta = sched.build_connector_meta(SimpleNamespace())
    assert meta.holds == {"r1": ("a", "b")}
    assert meta.per_node == {"a": "meta-a", "b": "meta-b"}
    worker = chain(
        {
            "a": {"plugin": "tier", "config": {"hold": True}},
            "b": {"plugin": "tier", "config": {"hold": True}},
        },
        role="worker",
    )
    worker.bind_connector_metadata(meta)
    assert [(n, a) for n, h, a in CALLS if h == "bind_connector_metadata"] == [
        ("a", "meta-a"),
        ("b", "meta-b"),
    ]
    # Both nodes report r1 done in the same step: only then is it finished.
    assert worker.get_transfer_results({"r1"}).finished_sending == {"r1"}


def test_transfer_params_merge_and_clash_names_both_nodes() -> None:
    ok = chain(
        {
            "a": {"plugin": "tier", "config": {"params": {"x": 1}}},
            "b": {"plugin": "tier", "config": {"params": {"y": 2}}},
        }
    )
    assert ok.request_finished(request(), []) == (False, {"x": 1, "y": 2})
    clash = chain(
        {
            "a": {"plugin": "tier", "config": {"params": {"x": 1}}},
            "b": {"plugin": "tier", "config": {"params": {"x": 2}}},
        }
    )
    with pytest.raises(TransferParamsClash, match='node "a" and node "b"'):
        clash.request_finished(request(), [])


def _load_through(policy: str) -> WorkerChain:
    nodes = {
        "a": {
            "plugin": "tier",
            "on_error": policy,
            "config": {"hit": 8, "fail_in": "start_load_kv"},
        }
    }
    sched = chain(nodes)
    sched.get_num_new_matched_tokens(request(), 0)
    sched.update_state_after_alloc(request(), Blocks(), 8)
    meta = sched.build_connector_meta(SimpleNamespace())
    assert meta.loads == {"a": {10, 11}}  # 8 tokens = the first two 4-token blocks
    worker = chain(nodes, role="worker")
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    return worker


def test_failed_load_becomes_load_errors_and_node_stays_with_recompute() -> None:
    worker = _load_through("recompute")
    assert worker.get_block_ids_with_load_errors() == {10, 11}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    report = worker.take_stats()
    assert switched_off(report) == set() and report["a"]["counters"]["errors"] == 1


def test_disable_policy_switches_the_node_off() -> None:
    worker = _load_through("disable")
    assert worker.get_block_ids_with_load_errors() == {10, 11}
    assert switched_off(worker.take_stats()) == {"a"}
    CALLS.clear()
    worker.start_load_kv(None)  # the next step's load: "a" is no longer called
    assert CALLS == [] and worker.get_block_ids_with_load_errors() == set()


def test_fail_policy_raises() -> None:
    with pytest.raises(RuntimeError, match="fails in start_load_kv"):
        _load_through("fail")


def test_per_layer_hooks_call_only_implementing_saving_nodes() -> None:
    c = chain(
        {
            "a": {"plugin": "tier"},
            "s": {"plugin": "saver"},
            "t": {"plugin": "saver", "role": "load"},
        },
        role="worker",
    )
    assert c.implemented("save_kv_layer") == ["s"]  # t loads only; a has no hook
    c.save_kv_layer("layer0", None, None)
    assert [(n, h) for n, h, _ in CALLS] == [("s", "save_kv_layer")]
    empty = chain({"a": {"plugin": "tier"}}, role="worker")
    assert empty.implemented("save_kv_layer") == []
    assert empty.save_kv_layer("layer0", None, None) is None


def test_misspelled_hookimpl_is_an_error() -> None:
    with pytest.raises(pluggy.PluginValidationError, match="start_lod_kv"):
        chain({"m": {"plugin": "misspelled"}})


@pytest.mark.parametrize(
    ("plugin", "hook", "option"),
    [("ordered", "on_new_request", "tryfirst"), ("wrapping", "wait_for_save", "wrapper")],
)
def test_hookimpl_options_the_chain_cannot_honour_are_refused(
    plugin: str, hook: str, option: str
) -> None:
    # Nodes are called once each in pipeline order: an option that reorders or
    # wraps calls would be silently ignored, so it is an error naming node and hook.
    with pytest.raises(ValueError, match=f"node 'x' hook '{hook}': {option}=True"):
        chain({"a": {"plugin": "tier"}, "x": {"plugin": plugin}})


def test_trace_logs_every_hook_call_through_pluggys_tracer() -> None:
    traced: list[str] = []
    c = chain({"a": {"plugin": "saver"}, "b": {"plugin": "tier"}}, role="worker", trace=True)
    c.pm.trace.root.setwriter(traced.append)
    c.save_kv_layer("layer.0", None, None)
    c.start_load_kv(None)
    text = "".join(traced)
    assert "save_kv_layer node=a" in text and "'layer.0'" in text
    assert "start_load_kv node=a" in text and "start_load_kv node=b" in text
    untraced = chain({"a": {"plugin": "saver"}}, role="worker")
    untraced.pm.trace.root.setwriter(traced.append)
    traced.clear()
    untraced.save_kv_layer("layer.0", None, None)
    assert traced == []


def test_stats_are_reported_when_a_node_counts_and_not_otherwise() -> None:
    c = chain({"a": {"plugin": "tier"}, "b": {"plugin": "tier"}})
    assert c.take_stats() == {}  # nothing counted: the one-check path
    c.stats["b"].extra.add("evictions", 2)
    report = c.take_stats()
    assert list(report) == ["b"] and report["b"]["counters"]["extra"] == {"evictions": 2}
    assert c.take_stats() == {}  # reported once, then reset
    c.stats["a"].gauges["pool_use"] = 0.5
    assert c.take_stats()["a"]["counters"]["gauges"] == {"pool_use": 0.5}
    c.stats["a"].gauges["pool_use"] = 0.5  # the same value again is no news
    assert c.take_stats() == {}
    c.get_num_new_matched_tokens(request(), 0)  # the chain's own counters
    report = c.take_stats()
    assert report["a"]["counters"]["lookups"] == 1
    # gauges ride along with every report of their node
    assert report["a"]["counters"]["gauges"] == {"pool_use": 0.5}


class Evented(Plugin):
    """Emits vLLM's own KV cache events."""

    @hookimpl
    def take_events(self) -> list[Any]:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        stored = BlockStored(
            block_hashes=[1],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        return [
            stored,
            BlockRemoved(block_hashes=[2], medium="CPU", ownership="lmcache"),
            AllBlocksCleared(),
        ]


def test_kv_events_come_from_every_node_tagged_with_the_node_id() -> None:
    registry = discover(extra=[_Module(), _EventsModule()], entry_points=False)
    resolved = load_pipeline(
        {"version": 1, "nodes": {"a": {"plugin": "evented"}, "b": {"plugin": "evented"}}},
        registry=registry,
    )
    events = list(SchedulerChain(resolved, kv_cache_config=KV_CACHE_CONFIG).take_events())
    assert [type(e).__name__ for e in events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ] * 2
    # A tier the event already names is kept; otherwise it is the node.
    assert [getattr(e, "ownership", None) for e in events] == [
        "a",
        "lmcache",
        None,
        "b",
        "lmcache",
        None,
    ]


def test_every_nodes_kv_events_are_counted_on_its_stats() -> None:
    registry = discover(extra=[_Module(), _EventsModule()], entry_points=False)
    resolved = load_pipeline(
        {"version": 1, "nodes": {"a": {"plugin": "evented"}, "b": {"plugin": "evented"}}},
        registry=registry,
    )
    chain = SchedulerChain(resolved, kv_cache_config=KV_CACHE_CONFIG)
    list(chain.take_events())
    stats = chain.take_stats()
    for node in ("a", "b"):
        extra = stats[node]["counters"]["extra"]
        # Blocks announced (one stored, one removed), and one clear.
        assert (extra["events_stored"], extra["events_removed"], extra["events_cleared"]) == (
            1,
            1,
            1,
        )


class _EventsModule:
    __name__ = "events"

    @staticmethod
    @hookimpl
    def register_plugin_types(register: Any) -> None:
        register(PluginType(name="evented", node=Evented, capabilities=Capabilities()))


# -- several KV cache groups (vLLM's hybrid manager) ------------------------- #

#: Block 0 is vLLM's null block: the window has left those positions.
HYBRID_BLOCKS = ([0, 21, 22, 23], [10, 11, 12, 13])


def _hybrid_load(policy: str, fail_in: str | None) -> tuple[WorkerChain, Any]:
    config = {"hit": 12, "fail_in": fail_in}
    nodes = {"a": {"plugin": "hybrid-tier", "on_error": policy, "config": config}}
    CALLS.clear()
    resolved = load_pipeline({"version": 1, "nodes": nodes, "hma": "on"}, registry=REGISTRY)
    sched = SchedulerChain(resolved, kv_cache_config=HYBRID_KV_CACHE_CONFIG)
    # The node loads synchronously; vLLM takes failures of several groups only
    # per request, from async loads: the chain makes the load async for vLLM.
    assert sched.get_num_new_matched_tokens(request(), 0) == (12, True)
    sched.update_state_after_alloc(request(), Blocks(*HYBRID_BLOCKS), 12)
    meta = sched.build_connector_meta(SimpleNamespace())
    assert meta.loads == {"a": {21, 22, 10, 11, 12}}  # never the null block
    assert async_loads(meta) == {"r1": (("a", frozenset({21, 22, 10, 11, 12}), True),)}
    worker = WorkerChain(resolved, kv_cache_config=HYBRID_KV_CACHE_CONFIG)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    return worker, worker.get_transfer_results(set())


@pytest.mark.parametrize("policy", ["recompute", "disable"])
def test_several_groups_a_failed_load_fails_the_request_not_blocks(policy: str) -> None:
    worker, results = _hybrid_load(policy, "start_load_kv")
    assert results.finished_recving == {"r1"} and results.failed_recving == {"r1"}
    # vLLM stops the engine on block ids with several groups: none are given.
    assert worker.get_block_ids_with_load_errors() == set()
    assert ("a" in switched_off(worker.take_stats())) == (policy == "disable")


def test_several_groups_a_good_load_is_reported_done_once() -> None:
    worker, results = _hybrid_load("recompute", None)
    assert results.finished_recving == {"r1"} and not results.failed_recving
    assert worker.get_block_ids_with_load_errors() == set()
    again = worker.get_transfer_results(set())
    assert not again.finished_recving and not again.failed_recving


def test_several_groups_fail_policy_still_stops_the_engine() -> None:
    with pytest.raises(RuntimeError, match="fails in start_load_kv"):
        _hybrid_load("fail", "start_load_kv")


@pytest.mark.parametrize("groups", [([7, 8],), ([0, 21], [10, 11])])
def test_with_hma_a_node_with_only_request_finished_still_holds_blocks(groups: Any) -> None:
    """vLLM calls request_finished_all_groups on an HMA connector, one group or several:
    a node that implements only request_finished is told too (else its async saves
    would read blocks vLLM already freed)."""
    CALLS.clear()
    nodes = {"a": {"plugin": "hybrid-tier", "config": {"hold": True}}}
    resolved = load_pipeline({"version": 1, "nodes": nodes}, registry=REGISTRY)
    assert resolved.hma
    sched = SchedulerChain(resolved, kv_cache_config=HYBRID_KV_CACHE_CONFIG)
    hold, _ = sched.request_finished_all_groups(request(), groups)
    assert hold and ("a", "request_finished", None) in CALLS


def test_a_request_has_one_view_from_its_first_call_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Made when vLLM first shows the request, its controls parsed once, dropped at its end."""
    import composer.views

    parsed: list[Any] = []
    real = composer.views.controls_of
    monkeypatch.setattr(composer.views, "controls_of", lambda p: parsed.append(p) or real(p))
    Viewer.seen = []
    c = chain({"a": {"plugin": "viewer"}, "b": {"plugin": "tier", "config": {"hit": 0}}})
    r = request()
    r.kv_transfer_params = {"kv_load_tiers": ["a"]}
    assert c.get_num_new_matched_tokens(r, 0) == (8, False)
    assert c.get_num_new_matched_tokens(r, 0) == (8, False)  # vLLM may ask again
    c.update_state_after_alloc(r, Blocks(), 8)
    r.status = "finished"
    c.request_finished(r, [1, 2])
    views = {id(view) for _, view in Viewer.seen}
    assert [hook for hook, _ in Viewer.seen] == ["lookup", "lookup", "alloc", "finished"]
    assert len(views) == 1 and Viewer.seen[0][1].raw is r
    assert [(r.node, r.start, r.tokens) for r in Viewer.seen[-1][1].loads] == [("a", 0, 8)]
    assert len(parsed) == 1  # the controls, once
    # Dropped at its end: the request object seen again gets a new view.
    c.get_num_new_matched_tokens(r, 0)
    assert id(Viewer.seen[-1][1]) not in views and len(parsed) == 2


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_chain_keeps_few_enough_members_for_cpythons_fast_attributes(role: str) -> None:
    """Over 30 instance attributes, CPython gives the object a dict of its own keys
    and every ``self.x`` on the per-layer and per-step paths gets slower (make bench's
    dispatch saw +8 % at 30): a part's state goes in one member (``LoadState``)."""
    c = chain({"a": {"plugin": "tier"}, "b": {"plugin": "tier"}}, role=role)
    assert len(vars(c)) < 30, sorted(vars(c))
