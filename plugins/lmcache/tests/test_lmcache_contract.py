"""The in-process node held to LMCache's real contract (LMCache 0.5.6's own classes).

Every call the node makes into LMCache runs LMCache's code: its
``LMCacheConnectorV1Impl``, its ``LMCacheManager`` (degraded mode included),
its config, its request-config and key functions. Only what needs CUDA is a
stand-in (:mod:`lmcache_standins`): the engine, and a lookup client answering
as LMCache's answer (an int, None while pending, -1 for no result yet).
Each answer is driven through KV Composer's chain, as vLLM's scheduler calls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import torch
from kvc_lmcache import lmcache_internals, memory
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.inprocess import LMCacheContractError, LMCacheDegraded, LMCacheInProcessNode
from kvc_lmcache.lmcache_internals import LMCacheIncompatible, Reach, check_reach
from kvc_lmcache.server_node import LMCacheServerNode
from kvc_lmcache.tenants import SALT_TAG, HashedSalt, salt_tag
from lmcache.utils import CacheEngineKey
from lmcache.v1.token_database import ChunkedTokenDatabase
from lmcache_standins import BLOCK, StandInFactory, StandInLookup, request, stand_in, vllm_config
from structlog.testing import capture_logs
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import RequestStatus

from composer import load_pipeline
from composer.testing.chains import chain_for

#: LMCache's reason when its engine cannot be built (what its GPU connector raises here).
NO_CUDA = "LMCache's GPU connector needs CUDA: no CUDA device is available"


@pytest.fixture(autouse=True)
def no_memory_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without an engine no CPU buffer is allocated (the check has its own tests).
    monkeypatch.setattr(memory, "available_memory", lambda: (2**60, 2**60))


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)],
    )


def chain(role: str = "scheduler", on_error: str = "fail", **config: Any) -> Any:
    node = {"plugin": "lmcache", "on_error": on_error, "config": {"mode": "in_process", **config}}
    pipeline = load_pipeline({"version": 1, "nodes": {"lm": node}})
    return chain_for(pipeline, role, vllm_config=vllm_config(), kv_cache_config=kv_cache_config())


# -- lookups: every answer LMCache gives ---------------------------------------------- #


@pytest.mark.parametrize(
    ("hits", "tokens", "computed", "expected"),
    [
        (64, 100, 0, 64),  # LMCache's hit beyond what vLLM computed
        (64, 100, 32, 32),
        (100, 100, 0, 99),  # a full hit: LMCache leaves the last token to compute
        (0, 100, 0, 0),
        (32, 100, 64, 0),  # vLLM's own prefix cache holds more
    ],
)
def test_a_lookup_answered_with_an_int(
    monkeypatch: pytest.MonkeyPatch, hits: int, tokens: int, computed: int, expected: int
) -> None:
    # LMCache 0.5.6 answers an int; the node once unpacked a pair from it and
    # stopped the engine at its first request (TypeError: cannot unpack).
    stand_in(monkeypatch, StandInLookup(hits))
    c = chain()
    assert c.get_num_new_matched_tokens(request("r1", tokens), computed) == (expected, False)


def test_a_pending_lookup_is_asked_again_on_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    lookup = StandInLookup(hits=48, pending=3)
    stand_in(monkeypatch, lookup)
    c = chain()
    r = request("r1", 100)
    # LMCache's asynchronous lookup: None while it runs; vLLM's scheduler keeps the
    # request waiting and asks again on each step.
    assert [c.get_num_new_matched_tokens(r, 0) for _ in range(3)] == [(None, False)] * 3
    assert c.get_num_new_matched_tokens(r, 0) == (48, False)
    assert len(lookup.lookups) == 1  # one lookup; the rest read LMCache's lookup cache


def test_no_result_yet_starts_a_lookup_and_a_result_is_read_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lookup = StandInLookup(hits=32)
    stand_in(monkeypatch, lookup)
    c = chain()
    r = request("r1", 100)
    assert lookup.lookup_cache("r1") == -1  # (LMCache's "no result cached")
    assert c.get_num_new_matched_tokens(r, 0) == (32, False)
    assert c.get_num_new_matched_tokens(r, 0) == (32, False)  # vLLM may ask twice
    assert len(lookup.lookups) == 1


@pytest.mark.parametrize("answer", [(64, False), "64", 1.5, -2, True])
def test_an_answer_no_lmcache_release_gives_is_named(
    monkeypatch: pytest.MonkeyPatch, answer: Any
) -> None:
    stand_in(monkeypatch, StandInLookup(0))
    c = chain()
    c.nodes["lm"].impl.get_num_new_matched_tokens = lambda request, n: answer
    with pytest.raises(RuntimeError) as err:  # the chain's NodeFailed: on_error is fail
        c.get_num_new_matched_tokens(request("r1", 100), 0)
    assert type(err.value).__name__ == "NodeFailed"
    assert isinstance(err.value.__cause__, LMCacheContractError)
    assert f"get_num_new_matched_tokens returned {answer!r}" in str(err.value)
    assert "LMCache 0.5.6 returns the tokens to load (an int >= 0) or None" in str(err.value)


# -- degraded LMCache ------------------------------------------------------------------ #


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_degraded_lmcache_refuses_to_start_under_fail(
    monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    stand_in(monkeypatch, StandInLookup(64), engine_fails=NO_CUDA)
    with pytest.raises(LMCacheDegraded) as err:
        chain(role)
    message = str(err.value)
    assert message.startswith('lmcache node "lm": LMCache runs degraded')
    assert f"RuntimeError: {NO_CUDA}" in message  # LMCache's own reason
    assert "on_error is fail, so the engine does not start" in message


@pytest.mark.parametrize("on_error", ["recompute", "disable"])
def test_degraded_lmcache_serves_nothing_and_the_engine_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, on_error: str
) -> None:
    lookup = StandInLookup(64)
    stand_in(monkeypatch, lookup, engine_fails=NO_CUDA)
    with capture_logs() as logs:
        c = chain(on_error=on_error)
    said = [e for e in logs if "LMCache runs degraded" in e["event"]]
    assert len(said) == 1 and said[0]["log_level"] == "warning"
    assert said[0]["reason"] == f"RuntimeError: {NO_CUDA}"
    node = c.nodes["lm"]
    assert node.impl._manager._init_failed  # LMCache's own degraded mode
    assert c.stats["lm"].gauges["lmcache_degraded"] == 1
    for i in range(3):
        assert c.get_num_new_matched_tokens(request(f"r{i}", 100), 0) == (0, False)
    assert lookup.lookups == []
    # LMCache's own degraded metadata; nothing failed, nothing switched off.
    meta = c.build_connector_meta(scheduler_output([request("r0", 100)]))
    assert meta.per_node["lm"].requests == []
    assert c.stats["lm"].errors == 0 and "lm" not in c.disabled


def test_degraded_after_the_kv_caches_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # LMCache builds its worker's engine in post_init (register_kv_caches): a
    # failure there degrades it then, and is said then.
    stand_in(monkeypatch, None)
    c = chain("worker", on_error="recompute")
    node = c.nodes["lm"]
    assert node.degraded == ""

    def post_init_fails() -> None:
        node.impl._manager._handle_post_init_failure(RuntimeError(NO_CUDA))

    monkeypatch.setattr(node.impl._manager, "post_init", post_init_fails)
    with capture_logs() as logs:
        node.register_kv_caches(raw={"layers.0": torch.zeros(1)})
    assert node.degraded == f"RuntimeError: {NO_CUDA}"
    assert [e["event"] for e in logs if "degraded" in e["event"]] == [
        f'lmcache node "lm": LMCache runs degraded (it recomputes everything) since its KV '
        f"caches were registered: RuntimeError: {NO_CUDA}; the node serves and saves nothing"
    ]


# -- tenants --------------------------------------------------------------------------- #


def scheduler_output(requests: list[Any]) -> SchedulerOutput:
    new = [NewRequestData.from_request(r, ([1, 2, 3, 4, 5, 6, 7],)) for r in requests]
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r.request_id: r.num_tokens for r in requests},
        total_num_scheduled_tokens=sum(r.num_tokens for r in requests),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


@pytest.fixture
def tenants(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, StandInLookup]]:
    lookup = StandInLookup(hits=64)
    stand_in(monkeypatch, lookup)
    yield chain(), lookup


def test_a_salted_lookup_carries_its_tenants_tag(tenants: tuple[Any, StandInLookup]) -> None:
    c, lookup = tenants
    c.get_num_new_matched_tokens(request("a", 100, cache_salt="alice"), 0)
    c.get_num_new_matched_tokens(request("b", 100, cache_salt="bob"), 0)
    c.get_num_new_matched_tokens(request("u", 100), 0)
    configs = {rid: cfg for rid, _, cfg in lookup.lookups}
    assert configs["a"] == {SALT_TAG: salt_tag("alice")}
    assert configs["b"] == {SALT_TAG: salt_tag("bob")}
    assert configs["u"] is None  # unsalted: LMCache's plain keys


def test_a_tag_sent_by_a_client_is_not_trusted(tenants: tuple[Any, StandInLookup]) -> None:
    c, lookup = tenants
    forged = {SALT_TAG: salt_tag("alice"), "lmcache.tag.app": "x"}
    c.get_num_new_matched_tokens(request("u", 100, kv_transfer_params=forged), 0)
    c.get_num_new_matched_tokens(request("b", 100, "bob", kv_transfer_params=forged), 0)
    configs = {rid: cfg for rid, _, cfg in lookup.lookups}
    assert configs["u"] == {"lmcache.tag.app": "x"}
    assert configs["b"] == {SALT_TAG: salt_tag("bob"), "lmcache.tag.app": "x"}


def test_lmcaches_keys_of_two_salts_differ() -> None:
    # LMCache's own token database and keys: the tag is part of every chunk's key
    # and of its string (an L2 store's key), so one tenant's KV is never another's.
    from lmcache.v1.config import LMCacheEngineConfig

    config = LMCacheEngineConfig.from_defaults(chunk_size=16)
    db = ChunkedTokenDatabase(
        config, StandInFactory(config, None, "worker").get_or_create_metadata()
    )
    tokens = torch.arange(1, 65)

    def keys(configs: dict[str, Any] | None) -> list[CacheEngineKey]:
        return [k for _, _, k in db.process_tokens(tokens, request_configs=configs)]

    alice = keys({SALT_TAG: salt_tag("alice")})
    bob = keys({SALT_TAG: salt_tag("bob")})
    plain = keys(None)
    assert len(alice) == len(bob) == len(plain) == 4
    for a, b, p in zip(alice, bob, plain, strict=True):
        assert a.chunk_hash == b.chunk_hash == p.chunk_hash  # the same tokens
        assert len({a, b, p}) == 3 and len({a.to_string(), b.to_string(), p.to_string()}) == 3
    assert "alice" not in alice[0].to_string()  # the salt itself never lands in a store


def test_saves_carry_the_tenants_tag_and_an_unknown_request_is_not_saved(
    tenants: tuple[Any, StandInLookup],
) -> None:
    c, _ = tenants
    node = c.nodes["lm"]
    a, u, stranger = request("a", 100, "alice"), request("u", 100), request("s", 100, "eve")
    for r in (a, u):
        c.get_num_new_matched_tokens(r, 0)
    # (the stranger was never looked up by this node: its salt is unknown)
    c.build_connector_meta(scheduler_output([a, u, stranger]))
    trackers = node.impl._request_trackers
    assert trackers["a"].request_configs == {SALT_TAG: salt_tag("alice")}
    assert trackers["u"].request_configs is None
    assert trackers["s"].request_configs == {"lmcache.skip_save": True}
    # vLLM's own objects are untouched.
    assert a.sampling_params.extra_args is None


def test_finished_requests_leave_no_salt_behind(tenants: tuple[Any, StandInLookup]) -> None:
    c, _ = tenants
    r = request("a", 100, "alice")
    c.get_num_new_matched_tokens(r, 0)
    assert c.nodes["lm"].salts == {"a": "alice"}
    r.status = RequestStatus.FINISHED_STOPPED
    c.request_finished(r, [1, 2])
    assert c.nodes["lm"].salts == {}


# -- the next LMCache -------------------------------------------------------------------- #


def test_every_internal_the_node_reaches_is_in_the_installed_lmcache() -> None:
    assert lmcache_internals.lmcache_version() in lmcache_internals.TESTED
    for reach in lmcache_internals.REACHES:
        assert check_reach(reach) == [], reach.where


@pytest.mark.parametrize(
    ("reach", "problem"),
    [
        (
            Reach("lmcache.v1.manager:LMCacheManager", ("in_process",), attributes=("_gone",)),
            "lmcache.v1.manager:LMCacheManager has no attribute _gone",
        ),
        (
            Reach("lmcache.v1.manager:NoSuchManager", ("in_process",)),
            "lmcache.v1.manager:NoSuchManager is not there (AttributeError",
        ),
        (
            Reach("lmcache.v2.nothing:X", ("in_process",)),
            "lmcache.v2.nothing:X is not there (ModuleNotFoundError",
        ),
        (
            Reach(
                "lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl",
                ("in_process",),
                methods=(("update_state_after_alloc", 3),),
            ),
            "LMCacheConnectorV1Impl.update_state_after_alloc takes 2 to 2 arguments; the node "
            "passes 3",
        ),
        (
            Reach("lmcache.v1.manager:LMCacheManager", ("in_process",), methods=(("nope", 0),)),
            "lmcache.v1.manager:LMCacheManager.nope is not there",
        ),
    ],
)
def test_a_missing_or_changed_internal_is_named(reach: Reach, problem: str) -> None:
    (found,) = check_reach(reach)
    assert problem in found


CHANGED = Reach(
    "lmcache.v1.manager:LMCacheManager",
    ("in_process", "server"),
    attributes=("_renamed_in_the_next_release",),
    why="whether LMCache runs degraded",
)


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_node_whose_internals_changed_refuses_to_start_by_name(
    monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    stand_in(monkeypatch, StandInLookup(0))
    monkeypatch.setattr(lmcache_internals, "REACHES", (*lmcache_internals.REACHES, CHANGED))
    monkeypatch.setattr(lmcache_internals, "lmcache_version", lambda: "0.6.0")
    with pytest.raises(LMCacheIncompatible) as err:
        chain(role)
    assert str(err.value) == (
        'lmcache node "lm" (in_process) cannot run on the installed LMCache 0.6.0: '
        "lmcache.v1.manager:LMCacheManager has no attribute _renamed_in_the_next_release "
        "(whether LMCache runs degraded). It is tested with LMCache 0.5.6: install that release."
    )


def test_launch_problems_name_a_changed_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    # What `kvc validate --deep` reports, located at the node (tests/test_deep_check.py).
    monkeypatch.setattr(lmcache_internals, "REACHES", (*lmcache_internals.REACHES, CHANGED))
    for mode, cls in (("in_process", LMCacheInProcessNode), ("server", LMCacheServerNode)):
        assert cls.launch_problems(LMCacheConfig(mode=mode)) == [
            f"the installed LMCache 0.5.6 (tested: 0.5.6) lacks what mode {mode} reaches: "
            "lmcache.v1.manager:LMCacheManager has no attribute _renamed_in_the_next_release "
            "(whether LMCache runs degraded)"
        ]
    monkeypatch.setattr(lmcache_internals, "REACHES", ())
    assert LMCacheServerNode.launch_problems(LMCacheConfig()) == []


def test_an_untested_release_is_named_once(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, StandInLookup(0))
    monkeypatch.setattr(lmcache_internals, "lmcache_version", lambda: "0.6.0")
    monkeypatch.setattr(lmcache_internals, "_warned", [])
    with capture_logs() as logs:
        chain("scheduler")
        chain("worker")
    said = [e for e in logs if "LMCache 0.6.0" in e["event"]]
    assert [(e["event"], e["log_level"]) for e in said] == [
        (
            "LMCache 0.6.0 is installed; the lmcache node is tested with LMCache 0.5.6 (the "
            "internals it reaches were checked and are present)",
            "warning",
        )
    ]


# -- server mode's salts ------------------------------------------------------------------- #


@pytest.mark.parametrize("salt", ["alice", "a/b", "x@y", "back\\slash", "nul\x00", "z" * 300])
def test_any_salt_is_a_valid_lmcache_key_and_never_written_in_the_clear(salt: str) -> None:
    # LMCache's server keys objects by the request's cache_salt and refuses some
    # (a ValueError inside the server); the node shows it the salt's hash.
    from lmcache.v1.distributed.api import ObjectKey

    r = request("r1", 32, cache_salt=salt)
    shown = HashedSalt(r)
    key = ObjectKey(chunk_hash=b"\x01" * 8, model_name="m", kv_rank=0, cache_salt=shown.cache_salt)
    assert key.cache_salt == salt_tag(salt) != salt
    assert shown.request_id == "r1" and shown.all_token_ids is r.all_token_ids
    assert HashedSalt(request("r2", 32)).cache_salt is None
    if salt != "alice":
        with pytest.raises(ValueError, match="cache_salt"):
            ObjectKey(chunk_hash=b"\x01" * 8, model_name="m", kv_rank=0, cache_salt=salt)


def test_launch_problems_name_a_cpu_buffer_that_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda: (4 * 2**30, 16 * 2**30))
    config = LMCacheConfig(mode="in_process", max_local_cpu_size=8)
    assert LMCacheInProcessNode.launch_problems(config) == [
        "max_local_cpu_size 8 (8.0GiB of CPU buffer in this vLLM worker process) is more than "
        "the 4.0GiB of memory available on this machine (16.0GiB in all); lower "
        "max_local_cpu_size (each vLLM worker process allocates one)"
    ]
    assert (
        LMCacheInProcessNode.launch_problems(config.model_copy(update={"max_local_cpu_size": 2}))
        == []
    )
