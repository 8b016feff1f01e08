"""kvc_lmcache.resp_adapter against a real Valkey: LMCache's native RESP client, reconnecting.

LMCache 0.5.6's own client never reconnects: after its Valkey restarts every
operation fails (the first test pins that, so a fixed LMCache shows up here).
The wrapper fails fast while the store is gone and reconnects once it is back.
"""

from __future__ import annotations

import select
import time
from pathlib import Path
from typing import Any

import pytest
import valkey
from kvc_lmcache import resp_adapter
from kvc_lmcache.resp_adapter import ReconnectingRespClient

# Installed by `make test`: missing must fail, not skip.
from lmcache.lmcache_redis import LMCacheRedisClient

from composer.servers import ValkeyServer, ping, valkey_server


def wait(client: Any, future: int, timeout: float = 10.0) -> tuple[int, bool, str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([client.event_fd()], [], [], 0.2)
        for done in client.drain_completions():
            if done[0] == future:
                return tuple(done)
    raise AssertionError(f"future {future} never completed")


def set_one(client: Any, key: str, data: bytearray) -> bool:
    return wait(client, client.submit_batch_set([key], [memoryview(data)]))[1]


def stored_once_back(client: ReconnectingRespClient, key: str, data: bytearray) -> None:
    """Store ``key`` as soon as the client's own thread has reconnected."""
    deadline = time.monotonic() + 10
    while not set_one(client, key, data):
        assert time.monotonic() < deadline, "never reconnected"
        time.sleep(0.1)


def native(vk: ValkeyServer) -> Any:
    return LMCacheRedisClient(vk.host, vk.port, 2, "", "")


def test_lmcaches_own_client_loses_operations_after_a_restart(tmp_path: Path) -> None:
    """Why the wrapper exists: LMCache's client keeps its sockets, so after its
    Valkey restarts an operation goes to a dead one and fails (later ones fail
    too, on each worker's dead socket; seen here once to succeed on a worker
    that had reconnected: nothing the wrapper relies on)."""
    data = bytearray(b"x" * 4096)
    with valkey_server(tmp_path) as vk:
        client = native(vk)
        assert set_one(client, "a", data)
        vk.kill()
        vk.start()
        assert set_one(client, "b0", data) is False
        client.close()


def test_the_wrapper_fails_fast_while_down_and_reconnects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resp_adapter, "RETRY_S", 0.2)
    data = bytearray(b"y" * 4096)
    with valkey_server(tmp_path) as vk:
        client = ReconnectingRespClient(lambda: native(vk), lambda: ping(vk.host, vk.port))
        assert set_one(client, "a", data) and client.connected
        vk.kill()
        assert not set_one(client, "b", data)  # the dead connection is noticed
        assert not client.connected
        done = wait(client, client.submit_batch_exists(["a"]))
        assert done[1] is False and "unreachable" in done[2]
        vk.start()
        stored_once_back(client, "c", data)
        assert client.reconnects == 1
        out = bytearray(len(data))
        done = wait(client, client.submit_batch_get(["c"], [memoryview(out)]))
        assert done[1] and out == data
        assert valkey.Valkey(host=vk.host, port=vk.port).get("c") == bytes(data)
        client.close()


def test_the_wrapper_starts_while_the_store_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resp_adapter, "RETRY_S", 0.2)
    with valkey_server(tmp_path) as vk:
        vk.kill()
        client = ReconnectingRespClient(lambda: native(vk), lambda: ping(vk.host, vk.port))
        assert not client.connected
        assert not set_one(client, "a", bytearray(b"z" * 64))
        vk.start()
        stored_once_back(client, "a", bytearray(b"z" * 64))  # the PING thread reconnects
        client.close()
