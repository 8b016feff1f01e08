"""The server watcher against real `lmcache server`s: killed -> down, restarted -> up.

Each probe is driven by hand (``check()``), so the tests count probes, not
seconds: a pid probe notices a SIGKILLed server on the first probe after it
died, a network probe on the second (one slow answer is not an outage), and
the watcher probes every WATCH_INTERVAL s. One test runs the thread itself,
waiting on its callback (a generous bound only against a hang).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
from kvc_lmcache.lmcache_internals import degrade, fail_pending, lmcache_healthy
from kvc_lmcache.server_health import WATCH_INTERVAL, ServerWatcher, http_probe, tcp_probe
from kvc_lmcache.server_process import ServerInfo, ServerSettings, start_server

from composer.servers import alive, stop_process

SETTINGS = ServerSettings(chunk_size=32, l1_size_gb=0.1, transfer_mode="auto")


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[ServerInfo]:
    info = start_server(SETTINGS, tmp_path / "server.log")
    try:
        yield info
    finally:
        assert info.pid is not None
        stop_process(info.pid)


def _kill(info: ServerInfo) -> None:
    assert info.pid is not None
    os.kill(info.pid, signal.SIGKILL)
    while alive(info.pid):  # reaps it: it is our child
        time.sleep(0.01)


def _probes(info: ServerInfo) -> dict[str, tuple[Callable[[], bool], int]]:
    """Every probe kind, with the failures in a row the node needs to call it down."""
    assert info.pid is not None and info.http_url is not None
    return {
        "pid": (lambda: alive(info.pid), 1),
        "http": (http_probe(info.http_url), 2),
        "tcp": (tcp_probe(info.host, info.port), 2),
    }


def test_detection_stays_within_two_seconds_by_construction() -> None:
    # Down after at most `failures` probes, WATCH_INTERVAL apart; a dead
    # loopback server refuses a connection at once.
    assert 2 * WATCH_INTERVAL <= 1.0


@pytest.mark.parametrize("kind", ["pid", "http", "tcp"])
def test_a_killed_server_is_down_after_its_probes(server: ServerInfo, kind: str) -> None:
    probe, failures = _probes(server)[kind]
    changes: list[bool] = []
    watcher = ServerWatcher(probe, failures=failures, on_change=changes.append)
    assert watcher.check() and watcher.alive and changes == []
    _kill(server)
    for _ in range(failures - 1):
        assert watcher.check(), "down on one failed network probe"
    assert not watcher.check() and not watcher.alive
    assert changes == [False]
    assert not watcher.check() and changes == [False], "reported twice"


@pytest.mark.parametrize("kind", ["http", "tcp"])
def test_a_server_restarted_where_it_was_is_up_again(
    server: ServerInfo, kind: str, tmp_path: Path
) -> None:
    probe, failures = _probes(server)[kind]
    changes: list[bool] = []
    watcher = ServerWatcher(probe, failures=failures, on_change=changes.append)
    _kill(server)
    for _ in range(failures):
        watcher.check()
    assert not watcher.alive
    again = start_server(
        SETTINGS, tmp_path / "again.log", port=server.port, http_port=server.http_port
    )
    try:
        assert watcher.check() and watcher.alive
        assert changes == [False, True]
    finally:
        assert again.pid is not None
        stop_process(again.pid)


def test_one_failed_network_probe_is_not_an_outage() -> None:
    answers = iter([True, False, True, False, False, True])
    watcher = ServerWatcher(lambda: next(answers), failures=2)
    assert [watcher.check() for _ in range(6)] == [True, True, True, True, False, True]
    assert watcher.changes == 2


def test_a_failing_probe_or_callback_does_not_stop_the_watcher() -> None:
    def probe() -> bool:
        raise OSError("probe broke")

    def callback(alive: bool) -> None:
        raise RuntimeError("callback broke")

    watcher = ServerWatcher(probe, on_change=callback, on_tick=callback)
    assert not watcher.check() and not watcher.alive


def test_the_watcher_thread_reports_a_killed_server(server: ServerInfo) -> None:
    assert server.pid is not None
    down = threading.Event()
    watcher = ServerWatcher(
        lambda: alive(server.pid), on_change=lambda alive: None if alive else down.set()
    ).start()
    try:
        _kill(server)
        assert down.wait(timeout=60), "the watcher never noticed"
        assert not watcher.alive
    finally:
        watcher.stop()
    assert not watcher._thread.is_alive()


def test_a_wait_on_a_dead_server_ends_when_the_node_notices(server: ServerInfo) -> None:
    """LMCache's own client, waiting on a killed server: fail_pending ends the wait."""
    import zmq
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    client = RequestClientFactory.create(server.url, context=zmq.Context.instance())
    health = threading.Event()
    health.set()
    connector = SimpleNamespace(
        worker_adapter=SimpleNamespace(req_client=client, _health_event=health)
    )
    try:
        assert client.ping(None).result(timeout=30) is True
        _kill(server)
        future = client.ping(None)
        time.sleep(0.2)  # on its way: sent, unanswered
        assert not future.query()
        degrade(connector)
        assert not health.is_set() and not lmcache_healthy(
            SimpleNamespace(worker_adapter=SimpleNamespace(is_healthy=False))
        )
        fail_pending(connector, server.url)
        assert future.query(), "the wait would have lasted mq_timeout"
        with pytest.raises(TimeoutError, match=f"{server.url} is down"):
            future.result(timeout=0)
    finally:
        client.close()
