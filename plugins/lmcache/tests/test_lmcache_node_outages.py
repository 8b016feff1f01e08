"""The server node's outages, driven probe by probe: restarts of a server it started
(backoff, limit, a fresh budget per outage), a given server only waited for, and
L2 outages told from the server's L2 counters.

No server, engine or thread: vLLM's connector is a stand-in with no LMCache
adapters, the started server a :class:`FakeServer` whose restarts succeed or
fail as a test says, the restart thread runs each restart inside ``submit``,
the supervision's clock is a :class:`Clock` the test moves, and each probe (a
watcher tick) is one ``node.supervisor.watcher.check()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from kvc_lmcache import l2_stats, server_setup, supervision
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.l2_stats import L2Change, L2Health
from kvc_lmcache.server_errors import ServerDidNotStart, ServerDown, ServerReleased
from kvc_lmcache.server_health import ServerWatcher
from kvc_lmcache.server_node import LMCacheServerNode
from kvc_lmcache.server_process import ServerInfo
from kvc_lmcache.supervision import L2_SCRAPE_TICKS
from structlog.testing import capture_logs

from composer import NodeContext, Plugin, Unavailable
from composer.vllm import NativeConnectorNode

HOST = "127.0.0.1"


class Clock:
    """``supervision.py``'s ``time``: both clocks read ``now``; a sleep moves it on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Inline:
    """Stands in for the node's restart thread: the restart runs inside ``submit``."""

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)
        return future


class FakeServer:
    """Stands in for ``SharedServer``: the server runs while ``pid()`` names a live
    process (this one); each restart takes the next outcome: True, the server runs
    again, or an exception, raised as ``SharedServer.restart`` raises it."""

    started = True

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.running: int | None = os.getpid()
        self.outcomes: list[bool | Exception] = []
        #: The clock at each restart.
        self.restarts: list[float] = []

    def acquire(self) -> ServerInfo:
        return ServerInfo(HOST, 7000, 7001, pid=self.running)

    def pid(self) -> int | None:
        return self.running

    def kill(self) -> None:
        self.running = None

    def restart(self) -> tuple[ServerInfo, bool]:
        self.restarts.append(self.clock.now)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        self.running = os.getpid()
        return ServerInfo(HOST, 7000, 7001, pid=self.running), True

    def release(self) -> None:
        pass


class FakeConnector:
    """Stands in for LMCache's MP connector: no adapters (no degraded mode to enter),
    every lookup a miss (the requests it was shown kept)."""

    def __init__(self) -> None:
        self.shown: list[Any] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self.shown.append(request)
        return 0, False


def _native_init(self: NativeConnectorNode, ctx: NodeContext, connector: Any = None) -> None:
    Plugin.__init__(self, ctx)
    self.connector = FakeConnector()  # type: ignore[assignment]  # vLLM's, stood in for
    self.identity = {"name": connector.connector}


@dataclass
class Rig:
    node: LMCacheServerNode
    server: FakeServer
    clock: Clock
    logs: list[MutableMapping[str, Any]]
    #: What the server's /metrics and /status read as now, and the node's readings.
    l2: dict[str, int] = field(default_factory=lambda: counts())
    scrapes: int = 0

    def scrape(self, http_url: str) -> dict[str, int]:
        self.scrapes += 1
        return self.l2

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.node.supervisor.watcher.check()

    def read_l2(self, reading: dict[str, int]) -> None:
        """Tick until the node has read its server's L2 counters once more."""
        self.l2, before = reading, self.scrapes
        for _ in range(L2_SCRAPE_TICKS):
            self.tick()
            if self.scrapes > before:
                return
        raise AssertionError(f"no reading in {L2_SCRAPE_TICKS} ticks")

    def logged(self, start: str) -> list[MutableMapping[str, Any]]:
        return [e for e in self.logs if str(e["event"]).startswith(start)]

    @property
    def gauges(self) -> dict[str, float]:
        return dict(self.node.stats.gauges)


@pytest.fixture()
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Rig]]:
    clock = Clock()
    monkeypatch.setattr(supervision, "time", clock)
    monkeypatch.setattr(supervision, "_RESTARTS", Inline())
    monkeypatch.setattr(ServerWatcher, "start", lambda self: self)  # probed by hand
    monkeypatch.setattr(NativeConnectorNode, "__init__", _native_init)
    rigs: list[Rig] = []
    monkeypatch.setattr(l2_stats, "scrape", lambda http_url: rigs[-1].scrape(http_url))

    def build(server: dict[str, Any]) -> Rig:
        fake = FakeServer(clock)
        monkeypatch.setattr(server_setup, "SharedServer", lambda *args, **kwargs: fake)
        config = LMCacheConfig.model_validate({"server": server})
        node = LMCacheServerNode(NodeContext("lm", config, "both", "worker"))
        rigs.append(Rig(node, fake, clock, logs))
        return rigs[-1]

    # The node binds its logger when it is made: inside the capture, and at
    # structlog's defaults (a command run earlier in this process may have left
    # a level filter that drops the node's info lines).
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        with capture_logs() as logs:
            yield build
    finally:
        structlog.configure(**saved)


def counts(
    stored: int = 0,
    submitted: int | None = None,
    errors: int = 0,
    load_failed: int = 0,
    loaded: int = 0,
    hits: int = 0,
) -> dict[str, int]:
    """A reading of the server's L2 counters (``l2_stats.scrape``'s shape)."""
    submitted = stored if submitted is None else submitted
    return {
        "l2_store_chunks": submitted,
        "l2_stored_chunks": stored,
        "l2_load_failed": load_failed,
        "l2_loaded_chunks": loaded,
        "l2_hit_tokens": hits,
        "l2_failed": max(0, submitted - stored) + load_failed,
        "l2_errors": errors,
    }


def test_the_node_is_initialised_once_and_keeps_its_own_config(
    make: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Plugin.__init__`` runs once, from NativeConnectorNode's ``__init__``, with the
    node's own ctx; the connector is made from the native config it was handed."""
    configs: list[Any] = []
    init = Plugin.__init__

    def counted(self: Plugin[Any], ctx: NodeContext) -> None:
        configs.append(ctx.config)
        init(self, ctx)

    monkeypatch.setattr(Plugin, "__init__", counted)
    rig = make({"restarts": 5})
    assert [type(c).__name__ for c in configs] == ["LMCacheConfig"]
    assert isinstance(rig.node.config, LMCacheConfig) and rig.node.ctx.config is rig.node.config
    assert type(rig.node.native_config).__name__ == "VllmConnectorConfig"
    assert rig.node.identity == {"name": rig.node.native_config.connector}


# -- restarts of a server the node started ------------------------------------------ #


def test_a_started_server_that_dies_is_restarted_at_once(make: Callable[..., Rig]) -> None:
    rig = make({"restarts": 5})
    rig.server.outcomes = [True]
    rig.server.kill()
    rig.tick()  # noticed; the first try is due at once
    assert rig.server.restarts == [rig.clock.now]
    (down,) = rig.logged("LMCache server is down")
    assert down["event"].endswith("until it is restarted") and down["owned"] is True
    rig.tick()  # answers again: the restart taken, the node resumed
    (restarted,) = rig.logged("LMCache server restarted")
    assert restarted["tries"] == 1
    assert rig.node.supervisor.alive and len(rig.logged("LMCache server is back")) == 1
    assert rig.gauges["server_outages"] == 1 and rig.gauges["server_restarts"] == 1
    assert rig.gauges["server_restart_failures"] == 0 and rig.gauges["server_alive"] == 1


def _step_to(rig: Rig, at: float) -> None:
    """Tick just before ``at`` and at ``at``: a try due at ``at`` starts then, not earlier."""
    before = len(rig.server.restarts)
    rig.clock.now = at - 0.001
    rig.tick()
    assert len(rig.server.restarts) == before, f"a try before {at}"
    rig.clock.now = at
    rig.tick()
    assert len(rig.server.restarts) == before + 1, f"no try at {at}"
    rig.tick()  # its failure or success is taken


def test_failed_restarts_are_tried_again_1_2_then_4_s_after_each_failure(
    make: Callable[..., Rig],
) -> None:
    rig = make({"restarts": 5})
    refused = ServerDidNotStart("`lmcache server` exited with 1 while starting:\nits log")
    rig.server.outcomes = [refused, refused, refused, True]
    t0 = rig.clock.now
    rig.server.kill()
    rig.tick()  # try 1, at once
    rig.tick()  # its failure taken
    for at in (t0 + 1, t0 + 3, t0 + 7):
        _step_to(rig, at)
    assert [t - t0 for t in rig.server.restarts] == [0, 1, 3, 7]
    failed = rig.logged("LMCache server restart failed")
    assert [(e["tries"], e["limit"]) for e in failed] == [(1, 5), (2, 5), (3, 5)]
    assert {e["event"] for e in failed} == {"LMCache server restart failed"}
    assert {e["error"] for e in failed} == {"`lmcache server` exited with 1 while starting:"}
    assert [e["tries"] for e in rig.logged("LMCache server restarted")] == [4]
    rig.tick()
    assert rig.node.supervisor.alive
    assert rig.gauges["server_restarts"] == 1 and rig.gauges["server_restart_failures"] == 3


def test_after_its_last_try_the_node_stays_on_and_its_lookups_miss(
    make: Callable[..., Rig],
) -> None:
    rig = make({"restarts": 3})
    rig.server.outcomes = [ServerDidNotStart("refused")] * 3
    t0 = rig.clock.now
    rig.server.kill()
    rig.tick(2)
    for at in (t0 + 1, t0 + 3):
        _step_to(rig, at)
    for hours in range(1, 25):  # no try ever again in this outage
        rig.clock.now = t0 + 3600 * hours
        rig.tick(3)
    assert [t - t0 for t in rig.server.restarts] == [0, 1, 3]
    failed = rig.logged("LMCache server restart failed")
    assert [e["event"] for e in failed] == [
        "LMCache server restart failed",
        "LMCache server restart failed",
        "LMCache server restart failed; no tries left: its store stays away until vLLM restarts",
    ]
    assert failed[-1]["tries"] == failed[-1]["limit"] == 3
    assert rig.gauges["server_restart_failures"] == 3 and rig.gauges["server_restarts"] == 0
    assert rig.gauges["server_outages"] == 1 and rig.gauges["server_alive"] == 0
    # On, serving misses: the chain keeps a node that raises Unavailable.
    with pytest.raises(ServerDown, match="is down; the lookup skipped it") as gone:
        rig.node.get_num_new_matched_tokens(SimpleNamespace(raw=object()), 0)
    assert isinstance(gone.value, Unavailable)


def test_a_later_outage_has_all_its_tries_again(make: Callable[..., Rig]) -> None:
    rig = make({"restarts": 2})
    refused = ServerDidNotStart("refused")
    rig.server.outcomes = [refused, refused]
    rig.server.kill()
    rig.tick(2)
    _step_to(rig, rig.clock.now + 1)  # the second and last try
    assert len(rig.server.restarts) == 2 and not rig.node.supervisor.alive
    # The engine's other process starts it again: resumed, no second outage counted.
    rig.server.running = os.getppid()
    rig.tick(3)
    assert rig.node.supervisor.alive and not rig.logged("LMCache server was restarted")
    assert rig.gauges["server_outages"] == 1
    # It dies again: two tries again, the first at once.
    rig.clock.now += 60
    t1 = rig.clock.now
    rig.server.outcomes = [refused, True]
    rig.server.kill()
    rig.tick(2)
    _step_to(rig, t1 + 1)
    assert rig.server.restarts[2:] == [t1, t1 + 1]
    assert [e["tries"] for e in rig.logged("LMCache server restart failed")] == [1, 2, 1]
    assert [e["tries"] for e in rig.logged("LMCache server restarted")] == [2]
    rig.tick()
    assert rig.node.supervisor.alive
    assert rig.gauges["server_outages"] == 2 and rig.gauges["server_restarts"] == 1


def test_a_server_whose_starter_left_is_not_restarted_again(make: Callable[..., Rig]) -> None:
    rig = make({"restarts": 5})
    rig.server.outcomes = [ServerReleased("the process that started it has left")]
    rig.server.kill()
    rig.tick(2)
    rig.clock.now += 3600
    rig.tick(3)
    assert len(rig.server.restarts) == 1 and not rig.logged("LMCache server restart failed")
    assert len(rig.logged("LMCache server not restarted")) == 1


def test_a_given_server_is_only_waited_for(make: Callable[..., Rig]) -> None:
    rig = make({"url": "tcp://127.0.0.1:7000"})
    answers = [True]
    rig.node.supervisor.watcher.probe = lambda: answers[0]
    answers[0] = False
    rig.tick()
    assert rig.node.supervisor.alive, "down on one failed network probe"
    rig.tick()
    assert not rig.node.supervisor.alive
    (down,) = rig.logged("LMCache server is down")
    assert down["event"].endswith("until it answers again") and down["owned"] is False
    for _ in range(24):
        rig.clock.now += 3600
        rig.tick()
    answers[0] = True
    rig.tick()
    assert rig.node.shared is None and rig.node.supervisor.alive
    assert not [e for e in rig.logs if "restart" in str(e["event"])]
    assert rig.gauges["server_restarts"] == rig.gauges["server_restart_failures"] == 0
    assert len(rig.logged("LMCache server is back: resuming")) == 1


# -- L2 outages ---------------------------------------------------------------------- #


L2 = {"l2": [{"type": "resp", "host": HOST, "port": 6379}]}


def test_an_l2_outage_is_one_warning_when_it_begins_and_one_when_it_ends(
    make: Callable[..., Rig],
) -> None:
    rig = make(L2)
    assert (rig.gauges["l2_serving"], rig.gauges["l2_outages"]) == (1, 0)
    rig.read_l2(counts(stored=10, hits=256))
    assert not rig.logged("LMCache L2")
    t0 = rig.clock.now
    rig.read_l2(counts(stored=10, errors=4, hits=256))  # Valkey gone: the wrapper counts
    (failing,) = rig.logged("LMCache L2 store is failing")
    assert failing["tiers"] == "resp 127.0.0.1:6379" and failing["failed"] == 4
    assert (rig.gauges["l2_serving"], rig.gauges["l2_outages"]) == (0, 1)
    rig.clock.now += 2
    rig.read_l2(counts(stored=10, errors=9, hits=256))  # still failing
    rig.clock.now += 2
    rig.read_l2(counts(stored=10, errors=9, hits=256))  # no traffic: nothing known
    assert len(rig.logged("LMCache L2 store is failing")) == 1
    assert not rig.logged("LMCache L2 store serves again")
    rig.clock.now += 2
    rig.read_l2(counts(stored=14, errors=9, hits=512))  # back: stores complete again
    (back,) = rig.logged("LMCache L2 store serves again")
    assert back["down_s"] == rig.clock.now - t0 == 6 and back["failed"] == 9
    assert (rig.gauges["l2_serving"], rig.gauges["l2_outages"]) == (1, 1)
    rig.read_l2(counts(stored=20, errors=9, hits=768))
    rig.read_l2(counts(stored=20, errors=9, load_failed=2, hits=768))  # a second outage
    assert len(rig.logged("LMCache L2 store is failing")) == 2
    assert (rig.gauges["l2_serving"], rig.gauges["l2_outages"]) == (0, 2)
    rig.read_l2(counts(stored=20, errors=9, load_failed=2, loaded=4, hits=1024))
    assert len(rig.logged("LMCache L2 store serves again")) == 2
    assert rig.gauges["l2_serving"] == 1


def test_a_restarted_servers_l2_counters_count_from_zero(make: Callable[..., Rig]) -> None:
    rig = make({**L2, "restarts": 1})
    rig.read_l2(counts(stored=10, errors=3))
    rig.read_l2(counts(stored=14, errors=3))
    assert rig.gauges["l2_outages"] == 1 and rig.gauges["l2_serving"] == 1
    rig.server.outcomes = [True]
    rig.server.kill()
    rig.tick(2)
    assert rig.node.supervisor.alive and rig.gauges["server_restarts"] == 1
    # The new server's own three errors: as many as the old one had, all new.
    rig.read_l2(counts(stored=14, errors=3))
    assert rig.gauges["l2_outages"] == 2 and rig.gauges["l2_serving"] == 0
    assert [e["failed"] for e in rig.logged("LMCache L2 store is failing")] == [3, 3]


def test_l2_failures_before_the_first_reading_are_an_outage() -> None:
    # The RESP wrapper starts without its store when Valkey is down at start-up.
    health = L2Health()
    assert health.observe(counts(errors=3), now=5.0) == L2Change(serving=False, failures=3)


def test_a_store_in_flight_at_a_reading_is_no_failure() -> None:
    health = L2Health()
    assert health.observe(counts(stored=10, submitted=16), now=0.0) is None
    assert health.observe(counts(stored=16, submitted=20), now=2.0) is None
    assert health.observe(counts(stored=20, submitted=20), now=4.0) is None
    assert health.serving and health.outages == 0


def test_stores_that_never_complete_are_failures() -> None:
    """LMCache's own adapters (fs, resp without the wrapper) count no errors: a store
    that failed is one submitted and never completed."""
    health = L2Health()
    health.observe(counts(stored=10, submitted=10), now=0.0)
    assert health.observe(counts(stored=10, submitted=14), now=2.0) is None  # in flight
    assert health.observe(counts(stored=10, submitted=14, hits=64), now=4.0) == L2Change(
        serving=False, failures=4
    )
    # The same four, still not completed, are not counted again; lookups that hit
    # (the directory can still be read) do not end an outage of its stores.
    assert health.observe(counts(stored=10, submitted=14, hits=128), now=6.0) is None
    assert not health.serving
    # Four stores submitted since have completed: stores are served again.
    assert health.observe(counts(stored=14, submitted=18, hits=128), now=8.0) == L2Change(
        serving=True, failures=4, down_s=4.0
    )
    assert health.observe(counts(stored=14, submitted=18, hits=128), now=10.0) is None
    # Four more never complete: a second outage, of those four only.
    assert health.observe(counts(stored=14, submitted=22, hits=128), now=12.0) is None
    assert health.observe(counts(stored=14, submitted=22, hits=128), now=14.0) == L2Change(
        serving=False, failures=4
    )
    assert health.outages == 2


def test_a_restarted_servers_counters_start_again() -> None:
    health = L2Health()
    health.observe(counts(stored=100, errors=5, hits=4096), now=0.0)
    health.observe(counts(stored=100, errors=5, hits=4096), now=2.0)
    assert health.outages == 1  # the first reading's 5 errors
    health.observe(counts(stored=200, errors=5, hits=8192), now=4.0)
    assert health.serving
    # Restarted by the engine's other process: its counters are lower, not failures.
    assert health.observe(counts(stored=3, hits=64), now=6.0) is None
    assert health.serving and health.outages == 1
    # After new_server() (the node saw its server down) the next reading counts from 0.
    health.new_server()
    assert health.observe(counts(stored=1, errors=2), now=8.0) == L2Change(
        serving=False, failures=2
    )


@pytest.mark.parametrize("salt", ["tenant-a", "a/b@c", None])
def test_lmcache_is_shown_a_requests_salt_hashed(
    make: Callable[..., Rig], salt: str | None
) -> None:
    # LMCache's server writes a salt into its store keys in the clear and refuses
    # some (kvc_lmcache.tenants): it sees the salt's hash, whatever the salt.
    from kvc_lmcache.tenants import salt_tag

    rig = make({})
    raw = SimpleNamespace(request_id="r1", cache_salt=salt, all_token_ids=[1, 2])
    rig.node.get_num_new_matched_tokens(SimpleNamespace(raw=raw), 0)
    (shown,) = rig.node.connector.shown
    assert shown.cache_salt == (salt_tag(salt) if salt else None)
    assert shown.request_id == "r1" and shown.all_token_ids is raw.all_token_ids
