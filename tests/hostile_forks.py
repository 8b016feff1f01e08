"""``kvc validate`` on each hostile file, each in a process of its own, forked from one
that imported KV Composer once (run by ``tests/test_hostile.py``).

A fresh interpreter per file spent most of the corpus's time importing: ~0.2 s
of CPU 324 times. A forked child starts with ``composer.cli`` imported and then
runs what the ``kvc`` console script runs (``main()`` with its argv), under
``RLIMIT_AS`` (the limit holds the inherited interpreter too, as a fresh one's
did), with its own stdout and stderr files. Its CPU time (from ``wait4``) is
what validating the file cost; its peak resident memory (``VmHWM``) is written
next to its output; a child still running after the hang limit is killed.

Usage: ``python hostile_forks.py OUTPUTS MEMORY_LIMIT HANG_LIMIT_S WORKERS NAME...``;
writes ``OUTPUTS/results.json``: name -> [exit code or None, wall s, CPU s].
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback

from composer.cli import main


def _child(name: str, outputs: str, memory_limit: int) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
        for fd, kind in ((1, "out"), (2, "err")):
            target = os.open(f"{outputs}/{name}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = ["kvc", "validate", f"tests/hostile/{name}"]
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # as the interpreter would: the traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with open("/proc/self/status") as status:
                kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
            with open(f"{outputs}/{name}.rss", "w") as out:
                out.write(kib)
        finally:
            os._exit(code)


def run(outputs: str, memory_limit: int, hang_s: float, workers: int, names: list[str]) -> None:
    results: dict[str, list[float | int | None]] = {}
    pending = list(names)
    running: dict[int, tuple[str, float]] = {}
    while pending or running:
        while pending and len(running) < workers:
            name = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(name, outputs, memory_limit)
            running[pid] = (name, time.monotonic())
        time.sleep(0.002)
        for pid, (name, started) in list(running.items()):
            done_pid, status, usage = os.wait4(pid, os.WNOHANG)
            elapsed = time.monotonic() - started
            if done_pid == 0 and elapsed <= hang_s:
                continue
            code: int | None
            if done_pid == 0:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                code = None
            else:
                code = os.waitstatus_to_exitcode(status)
            results[name] = [code, elapsed, usage.ru_utime + usage.ru_stime]
            del running[pid]
    with open(f"{outputs}/results.json", "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    outputs, memory_limit, hang_s, workers, *names = sys.argv[1:]
    run(outputs, int(memory_limit), float(hang_s), int(workers), names)
