"""The child processes the project starts (its servers, test engines): one way to start
one with a log, make it die with its parent, read its log's tail, stop it or its
whole process group, and say whether it lives.

A child is started by :func:`spawn`, its output (stdout and stderr) in a log file,
its stdin ``/dev/null``; by default in a process group of its own
(``start_new_session``: a ^C in the terminal is not its signal, and everything it
starts is stopped with it by :func:`stop_group`). A process is named by its
``Popen`` where this process started it, or by its pid where it did not (a server
another process started, read from a state file): :func:`alive`,
:func:`stop_process` and :func:`kill_process` take either.

Each server's own health check (Valkey's PING, an HTTP ``/health``) stays with
that server; nothing here imports more than the standard library. Linux: ``prctl``,
``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: ``prctl`` option: the signal a process gets when the thread that started it ends.
PR_SET_PDEATHSIG = 1
#: A process named by its ``Popen`` (started here) or by its pid.
Process = subprocess.Popen[Any] | int


def spawn(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    append: bool = False,
    new_group: bool = True,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (in ``cwd``), its stdout and stderr written to ``log_path``
    (truncated, or appended to with ``append``), stdin ``/dev/null``; ``env`` is its
    whole environment (None: this process's).

    ``new_group``: in a process group of its own, led by it. ``die_with_parent``:
    the kernel sends it SIGTERM when the *thread* that started it ends (even by
    SIGKILL, and after this process ``exec``s another program): a crashed starter
    leaves no server behind. Start such a child from a thread that lives as long
    as the process when the calling one may not.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab" if append else "wb") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=new_group,
            preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509 (a prctl)
        )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the child before exec: SIGTERM when the starting thread ends (Linux prctl).
    A safety net: the child starts without it where prctl is missing."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, every thread) process ``pid`` has used so far, from
    Linux's ``/proc``; None where it cannot be read (gone, another system)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # After the command's name (in parentheses, which may hold spaces): the state,
        # then fields 4..; utime and stime are fields 14 and 15, in clock ticks.
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def tail(log_path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log, for an error message (``(no log)`` without one)."""
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def alive(process: Process | None) -> bool:
    """Whether the process runs. A ``Popen``: it has not exited. A pid: it exists and
    has not ended. A child of this process that has ended is reaped here; another
    process's ended child counts as gone while it waits for its parent to reap it
    (the engine's other process sees a killed server that way)."""
    if process is None:
        return False
    if isinstance(process, subprocess.Popen):
        return process.poll() is None
    try:
        os.kill(process, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    with contextlib.suppress(ChildProcessError):  # (not our child)
        if os.waitpid(process, os.WNOHANG)[0] != 0:
            return False
    try:
        # state, ppid, ..., num_threads: the fields after the command's ")".
        fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return True  # no procfs: signal 0 is all there is
    # A zombie whose threads still exit (for tens of ms after a SIGKILL) still holds
    # its files, a listening port among them: gone only once they have.
    return fields[0] not in ("Z", "X") or int(fields[17]) > 1


def stop_process(process: Process, grace: float = 10.0, kill_wait: float = 5.0) -> None:
    """SIGTERM; SIGKILL if it still runs after ``grace`` seconds; back once it has gone
    (or ``kill_wait`` more seconds have passed). Safe to call twice. The process
    only, not its group: for a process that starts none of its own."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        if not alive(process) or not _signal(process, sig):
            return
        _wait_gone(process, wait)


def kill_process(process: Process, wait: float = 5.0) -> None:
    """SIGKILL now, as a crash (no goodbye to its clients); back once it has gone."""
    if alive(process) and _signal(process, signal.SIGKILL):
        _wait_gone(process, wait)


def _signal(process: Process, sig: signal.Signals) -> bool:
    """Send ``sig``; False when the process is gone."""
    try:
        if isinstance(process, subprocess.Popen):
            process.send_signal(sig)
        else:
            os.kill(process, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(process: Process, timeout: float) -> None:
    if isinstance(process, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
        return
    deadline = time.monotonic() + timeout
    while alive(process) and time.monotonic() < deadline:
        time.sleep(0.05)


# -- process groups (children started with new_group) ------------------------------ #


def group_alive(pgid: int, zombies: bool = False) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie only waits to be
    reaped; counted only with ``zombies``)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            # state, ppid, pgrp, ...: the fields after the command's ")".
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue  # (gone meanwhile)
        if int(fields[2]) == pgid and (zombies or fields[0] != "Z"):
            return True
    return False


def _group_drained(pgid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for group ``pgid`` to end; whether it has."""
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_alive(pgid)


def stop_group(
    proc: subprocess.Popen[Any],
    grace: float = 60.0,
    *,
    signal_wait: float = 10.0,
    ask_leader: bool = True,
) -> bool:
    """Stop ``proc`` (a group leader: :func:`spawn` with ``new_group``) and every
    process of its group; True if a signal was needed.

    First the group may end by itself within ``grace`` seconds: a leader that
    runs gets SIGTERM alone (``ask_leader``; vLLM's API server then stops its
    engine and unlinks its shared memory); one that has exited leaves its
    children time to finish their teardown (one killed half-way leaves vLLM's
    shared memory behind). Whatever outlives that gets SIGTERM, then after
    ``signal_wait`` seconds SIGKILL, the whole group at once.
    """
    signalled = False
    if proc.poll() is None and ask_leader:
        signalled = True
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    elif proc.poll() is not None and _group_drained(proc.pid, grace):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return signalled or sig != signal.SIGTERM
        signalled = True
        try:
            proc.wait(timeout=signal_wait)
        except subprocess.TimeoutExpired:
            continue  # the leader outlived it: the next signal at once
        if _group_drained(proc.pid, signal_wait):
            return True
    return True


def kill_group(proc: subprocess.Popen[Any], wait: float = 30.0) -> None:
    """SIGKILL to ``proc``'s whole group now (no goodbye to its peers); back once the
    leader has gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=wait)
