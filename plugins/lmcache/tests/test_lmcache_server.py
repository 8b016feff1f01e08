"""The started `lmcache server`: one per key, attach, last user stops it, checks before use."""

from __future__ import annotations

from pathlib import Path

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
from kvc_lmcache import memory as memory_module
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.server_errors import (
    ServerDidNotStart,
    ServerDoesNotFit,
    ServerUnreachable,
)
from kvc_lmcache.server_health import check_server, healthy
from kvc_lmcache.server_process import (
    ServerSettings,
    check_l1_fits,
    lmcache_command,
    server_argv,
)
from kvc_lmcache.server_setup import check_chunk_size, mp_extra_config
from kvc_lmcache.server_sharing import SharedServer

from composer.servers import alive


@pytest.fixture()
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVC_LMCACHE_STATE_DIR", str(tmp_path))
    return tmp_path


def test_argv_binds_loopback_and_names_every_required_flag() -> None:
    argv = server_argv(ServerSettings(chunk_size=64, transfer_mode="auto"), "127.0.0.1", 5, 6)
    assert argv[: len(lmcache_command()) + 1] == [*lmcache_command(), "server"]
    flags = dict(
        zip(
            argv[len(lmcache_command()) + 1 :: 2],
            argv[len(lmcache_command()) + 2 :: 2],
            strict=True,
        )
    )
    assert flags["--host"] == flags["--http-host"] == "127.0.0.1"
    assert (flags["--port"], flags["--http-port"], flags["--chunk-size"]) == ("5", "6", "64")
    assert flags["--eviction-policy"] == "LRU"  # without it the server refuses to start
    assert flags["--supported-transfer-mode"] == "auto"


def test_a_command_prefix_runs_the_server_under_it() -> None:
    prefix = ("taskset", "-c", "0")
    settings = ServerSettings(chunk_size=64, command_prefix=prefix)
    argv = server_argv(settings, "127.0.0.1", 5, 6)
    assert argv[: len(prefix) + len(lmcache_command()) + 1] == [
        *prefix,
        *lmcache_command(),
        "server",
    ]


def test_connector_extra_config() -> None:
    config = LMCacheConfig.model_validate({"server": {"mq_timeout": 5, "transfer_mode": "auto"}})
    assert mp_extra_config(config, "127.0.0.1", 7000) == {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": 7000,
        "lmcache.mp.mp_transfer_mode": "auto",
        "lmcache.mp.mq_timeout": 5.0,
    }


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    check_chunk_size(64, 32)
    with pytest.raises(
        ServerDoesNotFit, match="chunk size 48 is not a multiple of vLLM's block size 32"
    ):
        check_chunk_size(48, 32)


def test_one_server_per_key_shared_and_stopped_by_the_last_user(state: Path) -> None:
    settings = ServerSettings(chunk_size=32, l1_size_gb=0.1, transfer_mode="lmcache_driven")
    first, second = SharedServer("engine-a/lm", settings), SharedServer("engine-a/lm", settings)
    info = first.acquire()
    try:
        assert first.started and info.host == "127.0.0.1" and alive(info.pid)
        again = second.acquire()
        assert not second.started and (again.port, again.pid) == (info.port, info.pid)
        assert info.http_url and healthy(info.http_url)

        mp = check_server(info.http_url, block_size=32, transfer_mode="lmcache_driven")
        assert mp["chunk_size"] == 32
        with pytest.raises(
            ServerDoesNotFit, match="chunk size 32 is not a multiple of vLLM's block size 64"
        ):
            check_server(info.http_url, block_size=64, transfer_mode="lmcache_driven")
        with pytest.raises(
            ServerDoesNotFit,
            match="supports transfer mode lmcache_driven, but the connector uses engine_driven",
        ):
            check_server(info.http_url, block_size=32, transfer_mode="engine_driven")
        with pytest.raises(ServerDoesNotFit, match="auto may resolve to engine_driven"):
            check_server(info.http_url, block_size=32, transfer_mode="auto")

        first.release()
        assert alive(info.pid), "stopped while another user still holds it"
    finally:
        first.release()
        second.release()
    assert not alive(info.pid)
    assert not first.state_file.exists()
    second.release()  # twice is harmless


def test_a_server_that_cannot_start_is_a_clear_error(state: Path) -> None:
    bad = SharedServer(
        "engine-b/lm", ServerSettings(chunk_size=32, extra_args=("--max-workers", "x"))
    )
    with pytest.raises(ServerDidNotStart, match=r"`lmcache server` exited with \d+ while starting"):
        bad.acquire()


def test_an_unreachable_given_server(state: Path) -> None:
    with pytest.raises(ServerUnreachable, match="is not healthy"):
        check_server("http://127.0.0.1:9", block_size=32, transfer_mode="lmcache_driven", timeout=1)


def test_a_stale_state_file_never_signals_an_unrelated_process(state: Path) -> None:
    """A state file left by a SIGKILLed engine; its pid now belongs to someone else (us)."""
    import json
    import os

    shared = SharedServer("engine-c/lm", ServerSettings(chunk_size=32, l1_size_gb=0.1))
    stale = {"host": "127.0.0.1", "port": 1, "http_port": 2, "pid": os.getpid(), "users": ["1:1"]}
    shared.state_file.write_text(json.dumps(stale))
    info = shared.acquire()  # would SIGTERM this very test process if it trusted the pid
    try:
        assert shared.started and info.pid != os.getpid() and alive(info.pid)
    finally:
        shared.release()
    assert not alive(info.pid)


# -- an L1 larger than this machine's memory: an error at start, not an OOM kill ----- #

GiB = 2**30


def _memory(monkeypatch: pytest.MonkeyPatch, available: int, total: int = 64 * GiB) -> None:
    monkeypatch.setattr(memory_module, "available_memory", lambda: (available, total))


def test_an_l1_past_this_machines_memory_fails_before_a_server_starts(state: Path) -> None:
    l1_size_gb = 2**29  # valid (at most 1 EiB), and more than any machine here holds
    _, total = memory_module.available_memory()
    shared = SharedServer("engine-m/lm", ServerSettings(chunk_size=32, l1_size_gb=l1_size_gb), "lm")
    with pytest.raises(ServerDoesNotFit) as info:
        shared.acquire()
    message = str(info.value)
    assert message.startswith(
        'lmcache node "lm": server.l1_size_gb 536870912 (512.0PiB, the L1 of the '
        "`lmcache server` it starts) is more than the "
    )
    assert message.endswith(
        f"of memory available on this machine ({memory_module.human(total)} in all); "
        "lower server.l1_size_gb"
    )
    assert not shared.started and not shared.state_file.exists()


@pytest.mark.parametrize(
    ("l1_size_gb", "fits"), [(4.0, True), (4.0 + 1 / GiB, False), (0.5, True), (64.0, False)]
)
def test_the_l1_must_fit_in_the_memory_available_now(
    monkeypatch: pytest.MonkeyPatch, l1_size_gb: float, fits: bool
) -> None:
    _memory(monkeypatch, available=4 * GiB)
    settings = ServerSettings(chunk_size=32, l1_size_gb=l1_size_gb)
    if fits:
        check_l1_fits(settings, "lm")
        return
    with pytest.raises(
        ServerDoesNotFit, match=r"of memory available on this machine \(64\.0GiB in all\)"
    ):
        check_l1_fits(settings, "lm")


def test_a_restart_checks_the_memory_too(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server died; the memory it held went elsewhere meanwhile."""
    import json

    shared = SharedServer("engine-r/lm", ServerSettings(chunk_size=32, l1_size_gb=8), "lm")
    dead = {"host": "127.0.0.1", "port": 1, "http_port": 2, "pid": None}
    shared.state_file.write_text(
        json.dumps({**dead, "users": [shared.token], "starter": shared.token})
    )
    _memory(monkeypatch, available=2 * GiB)
    with pytest.raises(
        ServerDoesNotFit, match=r'^lmcache node "lm": server.l1_size_gb 8 \(8\.0GiB'
    ):
        shared.restart()
