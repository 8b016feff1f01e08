"""A test plugin that acts on the fleet's stores from inside a running engine.

Registered in vLLM's processes through ``$KV_COMPOSER_PLUGIN_MODULES``. The
``fleet-faults`` node comes first in ``load_order`` and ``needs`` the lmcache
node. In the scheduler, when it first sees the N-th request (1-based; round
``r``'s first request is ``r * prompts + 1``), it runs that request's actions
in order, before the lmcache node looks the request up:

* ``kill_valkey``: SIGKILL the Valkey server (pid from the config);
* ``kill_valkey_in_flight``: the same, ``delay_s`` later from a timer, while
  the round's requests are being computed and saved;
* ``wait_valkey_dead``: wait for that timer's kill to have happened and the
  process to be gone (its port free);
* ``restart_valkey``: start ``valkey-server`` again on its port (empty);
* ``wait_l2_connected``: hold the scheduler until the lmcache server's RESP
  adapter says it is connected again (its ``/status``): the Valkey outage's end;
* ``clear_l1``: empty the lmcache server's L1 (``POST /cache/clear``, again
  until its ``/status`` counts no object: a plain clear keeps what a store
  still holds locked), so the next lookups can only hit in its L2 tiers; one
  still not empty after 30 s is reported (``l1_not_emptied``);
* ``corrupt_fs``: damage every chunk file under ``fs_path``: every other one
  truncated to half its length, the others with 64 bytes in the middle flipped;
* ``fs_gone``: move the directory ``fs_path`` away and put a file in its place,
  so every open under it fails (a volume gone or remounted; as root,
  ``chmod`` would not stop a write); ``fs_back`` puts the directory back;
* ``fs_readonly`` / ``fs_writable``: remount the server's tmpfs at ``fs_mount``
  read-only (every write fails with EROFS, also for root) / read-write again;
* ``fs_full`` / ``fs_freed``: fill that tmpfs with a file (every write fails
  with ENOSPC) / delete it again;
* ``settle``: hold the scheduler ``settle_s`` seconds.

The ``fs`` actions act on the directory as the lmcache server sees it
(``/proc/<server pid>/root``): a server started under
:func:`server_on_own_tmpfs` (its ``server.command_prefix``) has its own mount
namespace, where a small tmpfs lies over ``fs_mount``. Each disk fault (``fs_gone``,
``fs_readonly``, ``fs_full``) records what it did to the disk, the chunk files
there when it started and ended, the server's L2 store failures (its
``/metrics``) then, and, once it ends, the seconds until the first chunk is
stored again.

It records per request the seconds from its first lookup to
``request_finished`` and vLLM's free KV blocks at each new request, and writes
(at every finished request and at shutdown) what it did and the lmcache node's
gauges to ``<report>.<process>.json``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

from lmcache_probe import LatencyProbe
from pydantic import BaseModel, ConfigDict

from composer import PluginType, hookimpl

Action = Literal[
    "kill_valkey",
    "kill_valkey_in_flight",
    "wait_valkey_dead",
    "restart_valkey",
    "wait_l2_connected",
    "clear_l1",
    "corrupt_fs",
    "fs_gone",
    "fs_back",
    "fs_readonly",
    "fs_writable",
    "fs_full",
    "fs_freed",
    "settle",
]
#: Each disk fault's first action, and the action that ends it.
FS_FAULTS = {"fs_gone": "fs_back", "fs_readonly": "fs_writable", "fs_full": "fs_freed"}

#: Runs before ``lmcache server`` (``$1`` mount, ``$2`` stage, ``$3`` size, then
#: the server's argv), as root of its own user and mount namespace: what
#: ``mount`` directory holds on disk is copied onto a tmpfs of that size laid
#: over it, seen by this process only. ``exec`` keeps the pid: the node's
#: watcher, ``stop_process`` and PR_SET_PDEATHSIG (kept across ``unshare``) see
#: the server itself; the tmpfs goes with the namespace when it exits.
SERVER_TMPFS_SCRIPT = """set -e
mount --bind "$1" "$2"
mount -t tmpfs -o size="$3" kvc-fleet-l2 "$1"
cp -a "$2/." "$1/"
umount "$2"
shift 3
exec "$@"
"""


def server_on_own_tmpfs(mount: Path, stage: Path, size: str) -> list[str]:
    """The lmcache node's ``server.command_prefix`` that starts its server inside
    ``unshare --user --mount``, on a tmpfs of ``size`` over ``mount``.

    Root can write to a directory whatever its mode, so a disk made read-only
    or full has to be a filesystem of the server's own: a tmpfs in a mount
    namespace of its own, which the test remounts read-only (``nsenter``)
    and fills (through ``/proc/<pid>/root``) without touching the machine's
    mounts. The test checks that the server did run in a namespace of its own.
    """
    return [
        "unshare", "--user", "--map-root-user", "--mount", "--",
        "sh", "-c", SERVER_TMPFS_SCRIPT, "sh", str(mount), str(stage), size,
    ]  # fmt: skip


class FleetFaultsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    report: str
    #: Request ordinal (1-based, as a string key) -> actions.
    actions: dict[str, list[Action]]
    valkey_pid: int | None = None
    valkey_port: int | None = None
    valkey_workdir: str | None = None
    fs_path: str | None = None
    #: The tmpfs under ``fs_path`` (``fs_readonly``, ``fs_full``).
    fs_mount: str | None = None
    delay_s: float = 0.3
    settle_s: float = 1.0


class FleetFaults(LatencyProbe):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.done: list[tuple[int, str, float]] = []
        self.valkey_pid = self.config.valkey_pid
        self.restarted_pids: list[int] = []
        self.corrupted = {"truncated": 0, "flipped": 0}
        #: (request ordinal, L1 objects left) for each ``clear_l1`` that timed out.
        self.l1_not_emptied: list[tuple[int, int]] = []
        self._timer: threading.Timer | None = None
        self.pool: Any = None
        self.free_blocks: list[int] = []
        #: One per disk fault, in order (see the module's docstring).
        self.fs_faults: list[dict[str, Any]] = []
        #: Read now: at shutdown the server may be gone.
        self.server_own_mount_ns = self._own_mount_ns()

    # -- actions ------------------------------------------------------------- #

    def _kill_valkey(self) -> None:
        assert self.valkey_pid is not None
        os.kill(self.valkey_pid, signal.SIGKILL)
        self._wait_dead(self.valkey_pid)

    @staticmethod
    def _wait_dead(pid: int, timeout: float = 10.0) -> None:
        """SIGKILL is delivered asynchronously: wait until the process holds no socket."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                return
            if state in ("Z", "X"):
                return
            time.sleep(0.01)
        raise TimeoutError(f"valkey-server {pid} still runs {timeout} s after SIGKILL")

    # -- the disk, as the lmcache server sees it ----------------------------- #

    def _server_root(self) -> str:
        """The server's view of the filesystem (its mount namespace, if it has one)."""
        return f"/proc/{self.target.supervisor.server.pid}/root"

    def _disk(self) -> Path:
        assert self.config.fs_path is not None
        return Path(self._server_root() + self.config.fs_path)

    def _mount(self) -> Path:
        assert self.config.fs_mount is not None
        return Path(self._server_root() + self.config.fs_mount)

    def _chunks(self) -> set[str]:
        try:
            return {p.name for p in self._disk().iterdir() if p.suffix == ".data"}
        except OSError:  # gone (a file in its place)
            return set()

    def _l2_failed(self) -> int:
        """The server's L2 failures now (its /metrics; read here, not through the
        node, whose own readings every 2 s are what it reports outages from)."""
        from kvc_lmcache import l2_stats

        counts = l2_stats.scrape(self.target.supervisor.server.http_url)
        assert counts is not None, "the lmcache server's /metrics did not answer"
        return counts["l2_failed"]

    def _write_error(self) -> str | None:
        """Write one byte to a new file in the disk's directory: the error's name, or None."""
        probe = self._disk() / ".kvc-probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        return None

    def _fault_starts(self, action: str) -> None:
        self.fs_faults.append(
            {
                "fault": action,
                "server_pid": self.target.supervisor.server.pid,
                "chunks_at_start": len(self._chunks()),
                "l2_failed_at_start": self._l2_failed(),
                "write_error_before": self._write_error(),
                "write_error": None,
                "write_error_after": None,
                "chunks_at_end": None,
                "l2_failed_at_end": None,
                "ended_at": None,
                "stored_again_s": None,
            }
        )

    def _fault_ends(self, action: str) -> None:
        fault = self.fs_faults[-1]
        assert FS_FAULTS[fault["fault"]] == action, (fault, action)
        fault["chunks_at_end"] = len(self._chunks())
        fault["l2_failed_at_end"] = self._l2_failed()

    def _fault_ended(self) -> None:
        """Time the disk's return: until a chunk not there before is stored (thread)."""
        fault = self.fs_faults[-1]
        before = self._chunks()
        fault["ended_at"] = time.monotonic()

        def watch() -> None:
            deadline = fault["ended_at"] + 60.0
            while time.monotonic() < deadline:
                if self._chunks() - before:
                    # Keys set up front: write_report may be dumping this dict.
                    fault["stored_again_s"] = time.monotonic() - fault["ended_at"]
                    self.write_report()
                    return
                time.sleep(0.01)

        threading.Thread(target=watch, daemon=True, name="kvc-fleet-disk-watch").start()

    def _remount(self, mode: str, timeout: float = 10.0) -> None:
        assert self.config.fs_mount is not None
        pid = self.target.supervisor.server.pid
        argv = [
            "nsenter", "-t", str(pid), "-U", "-m", "--preserve-credentials",
            "mount", "-o", f"remount,{mode}", self.config.fs_mount,
        ]  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                return
            # A file still open for writing (a save finishing) makes remount,ro busy.
            if "busy" not in done.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
            time.sleep(0.05)

    def _fill(self) -> None:
        filler = self._mount() / "filler"
        with open(filler, "wb", buffering=0) as f:
            free = os.statvfs(filler.parent)
            try:
                os.posix_fallocate(f.fileno(), 0, free.f_bavail * free.f_frsize)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
            block = bytes(4096)
            try:
                while True:  # whatever fallocate left, to the last page
                    f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def _corrupt_fs(self) -> None:
        files = sorted(p for p in self._disk().rglob("*") if p.is_file())
        for i, path in enumerate(files):
            data = bytearray(path.read_bytes())
            if i % 2 == 0:
                path.write_bytes(bytes(data[: len(data) // 2]))
                self.corrupted["truncated"] += 1
            else:
                middle = len(data) // 2
                for j in range(middle, min(middle + 64, len(data))):
                    data[j] ^= 0xFF
                path.write_bytes(bytes(data))
                self.corrupted["flipped"] += 1

    def _fs_gone(self) -> None:
        path = self._disk()
        path.rename(path.with_name(path.name + ".away"))
        path.write_text("not a directory\n")

    def _fs_back(self) -> None:
        path = self._disk()
        path.unlink()
        path.with_name(path.name + ".away").rename(path)

    def _restart_valkey(self) -> None:
        from composer.servers import ValkeyServer, valkey_server_binary

        assert self.config.valkey_port is not None and self.config.valkey_workdir is not None
        server = ValkeyServer(
            host="127.0.0.1",
            port=self.config.valkey_port,
            workdir=Path(self.config.valkey_workdir),
            binary=valkey_server_binary(),
        ).start()
        assert server.pid is not None
        self.valkey_pid = server.pid
        self.restarted_pids.append(server.pid)
        self.write_report()  # the test stops it, also if the engine dies later

    def _wait_l2_connected(self, timeout: float = 30.0) -> None:
        http_url = self.target.supervisor.server.http_url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{http_url}/status", timeout=5) as response:  # noqa: S310
                adapters = json.loads(response.read())["storage_manager"]["l2_adapters"]
            if all(a.get("connected", True) for a in adapters):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the RESP adapter did not reconnect within {timeout} s")

    def _clear_l1(self, ordinal: int, timeout: float = 30.0) -> None:
        # A plain clear keeps the objects a store still holds locked (the last
        # request's chunks on their way into a failing L2, say), and those
        # would be served next round: clear again until L1 holds nothing.
        http_url = self.target.supervisor.server.http_url
        request = urllib.request.Request(
            f"{http_url}/cache/clear",
            data=json.dumps({"tier": "l1", "force": False}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
                assert json.loads(response.read())["status"] == "ok"
            with urllib.request.urlopen(f"{http_url}/status", timeout=10) as response:  # noqa: S310
                l1s = json.loads(response.read())["storage_manager"]["l1_managers"].values()
            left = sum(l1["total_object_count"] for l1 in l1s)
            if not left:
                return
            if time.monotonic() > deadline:  # reported, the test says what it costs
                self.l1_not_emptied.append((ordinal, left))
                return
            time.sleep(0.05)

    def _run(self, ordinal: int, action: str) -> None:
        if action == "kill_valkey":
            self._kill_valkey()
        elif action == "kill_valkey_in_flight":
            self._timer = threading.Timer(self.config.delay_s, self._in_flight)
            self._timer.start()
            return
        elif action == "wait_valkey_dead":
            assert self._timer is not None
            self._timer.join(timeout=30)
        elif action == "restart_valkey":
            self._restart_valkey()
        elif action == "wait_l2_connected":
            self._wait_l2_connected()
        elif action == "clear_l1":
            self._clear_l1(ordinal)
        elif action == "corrupt_fs":
            self._corrupt_fs()
        elif action in FS_FAULTS:
            self._fault_starts(action)
            if action == "fs_gone":
                self._fs_gone()
            elif action == "fs_readonly":
                self._remount("ro")
            else:
                self._fill()
            # Checked once the fault is in place: the disk refuses a write.
            self.fs_faults[-1]["write_error"] = self._write_error()
        elif action in FS_FAULTS.values():
            self._fault_ends(action)
            if action == "fs_back":
                self._fs_back()
            elif action == "fs_writable":
                self._remount("rw")
            else:
                (self._mount() / "filler").unlink()
            self.fs_faults[-1]["write_error_after"] = self._write_error()
            self._fault_ended()
        elif action == "settle":
            time.sleep(self.config.settle_s)
        self.done.append((ordinal, action, time.monotonic()))

    def _in_flight(self) -> None:
        self._kill_valkey()
        self.done.append((-1, "kill_valkey_in_flight", time.monotonic()))

    # -- hooks --------------------------------------------------------------- #

    @hookimpl
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.pool = kv_cache_manager.block_pool

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:
        ordinal = self.first_lookup(request)
        if ordinal is None:
            return 0, False
        if self.pool is not None:  # before this request's blocks are allocated
            self.free_blocks.append(self.pool.get_num_free_blocks())
        for action in self.config.actions.get(str(ordinal), []):
            self._run(ordinal, action)
        return 0, False

    @hookimpl
    def shutdown(self) -> None:
        # The lmcache node reads its server's L2 metrics every 2 s: read them now.
        self.target.supervisor.scrape_l2()
        self.write_report()

    def report(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "restarted_pids": self.restarted_pids,
            "corrupted": self.corrupted,
            "l1_not_emptied": self.l1_not_emptied,
            "gauges": dict(self.target.stats.gauges),
            "free_blocks": self.free_blocks,
            "fs_faults": self.fs_faults,
            "server_own_mount_ns": self.server_own_mount_ns,
        }

    def _own_mount_ns(self) -> bool:
        """Does the server run in a mount namespace other than this process's?"""
        if self.target.supervisor.server.pid is None:  # a given server
            return False
        theirs = os.readlink(f"/proc/{self.target.supervisor.server.pid}/ns/mnt")
        return theirs != os.readlink("/proc/self/ns/mnt")


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="fleet-faults",
            node=FleetFaults,
            config=FleetFaultsConfig,
            default_role="load",
            roles=frozenset({"load"}),
        )
    )
