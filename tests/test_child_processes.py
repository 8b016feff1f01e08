"""The one home of the project's child processes (``composer.servers.process``): started
with a log, dying with their parent, their log's tail, stopped alone or with their
group, and whether they live. Real processes (Python one-liners), no server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from composer.servers import (
    alive,
    cpu_seconds,
    group_alive,
    kill_group,
    kill_process,
    spawn,
    stop_group,
    stop_process,
    tail,
)

#: A child that ignores SIGTERM (only SIGKILL ends it), once it says it is ready.
STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait_for(path: Path, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} never in {path}"
        time.sleep(0.02)


def test_output_goes_to_the_log_truncated_or_appended(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "child.log"
    code = "import sys; print('out'); print('err', file=sys.stderr); print(sys.stdin.read())"
    assert spawn(_python(code), log).wait(timeout=30) == 0
    assert log.read_text().split() == ["out", "err"]  # stdin is /dev/null
    assert spawn(_python("print('again')"), log, append=True).wait(timeout=30) == 0
    assert log.read_text().split() == ["out", "err", "again"]
    assert spawn(_python("print('new')"), log).wait(timeout=30) == 0
    assert log.read_text().split() == ["new"]


def test_env_is_the_whole_environment(tmp_path: Path) -> None:
    log = tmp_path / "env.log"
    env = {"PATH": os.environ.get("PATH", ""), "KVC_TEST_ONLY": "1"}
    code = "import os; print(sorted(k for k in os.environ if k.startswith('KVC_TEST')))"
    spawn(_python(code), log, env=env).wait(timeout=30)
    assert log.read_text().strip() == "['KVC_TEST_ONLY']"


def test_tail_is_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "t.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    assert tail(log, 3) == "line 37\nline 38\nline 39"
    assert len(tail(log).splitlines()) == 25
    assert tail(tmp_path / "missing.log") == "(no log)"


def test_a_new_group_is_led_by_the_child_unless_asked_otherwise(tmp_path: Path) -> None:
    own = spawn(_python("import time; time.sleep(600)"), tmp_path / "a.log")
    shared = spawn(_python("import time; time.sleep(600)"), tmp_path / "b.log", new_group=False)
    try:
        assert os.getpgid(own.pid) == own.pid
        assert os.getpgid(shared.pid) == os.getpgid(0)
    finally:
        kill_process(own)
        kill_process(shared)


def test_alive_by_popen_by_pid_and_none(tmp_path: Path) -> None:
    proc = spawn(_python("import time; time.sleep(600)"), tmp_path / "c.log")
    assert alive(proc) and alive(proc.pid) and not alive(None)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive(proc.pid):  # an ended child is reaped here
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not alive(proc)


def test_another_process_ended_child_counts_as_gone(tmp_path: Path) -> None:
    """A zombie of another parent (the engine's other process sees a killed server so)."""
    parent = subprocess.Popen(
        _python(
            textwrap.dedent(
                """
                import subprocess, sys, time
                child = subprocess.Popen([sys.executable, "-c", "pass"])
                print(child.pid, flush=True)
                time.sleep(600)  # never reaps it
                """
            )
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while alive(pid):
            assert time.monotonic() < deadline, "a zombie counted as alive"
            time.sleep(0.02)
        os.kill(pid, 0)  # it still exists: a zombie, not reaped by us
    finally:
        kill_process(parent)


def test_stop_process_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    proc = spawn(_python(STUBBORN), log)
    _wait_for(log, "ready")
    start = time.monotonic()
    stop_process(proc.pid, grace=0.5)  # by pid, as a process that did not start it
    assert time.monotonic() - start < 10
    assert not alive(proc.pid) and not alive(proc)
    stop_process(proc)  # twice is harmless


def test_stop_process_by_popen_and_sigterm(tmp_path: Path) -> None:
    proc = spawn(_python("import time; time.sleep(600)"), tmp_path / "p.log")
    stop_process(proc, grace=30)
    assert proc.returncode == -signal.SIGTERM


def test_kill_process_is_sigkill_at_once(tmp_path: Path) -> None:
    log = tmp_path / "k.log"
    proc = spawn(_python(STUBBORN), log)
    _wait_for(log, "ready")
    kill_process(proc)
    assert proc.returncode == -signal.SIGKILL


def test_a_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """``die_with_parent``: SIGTERM from the kernel when its starter is SIGKILLed."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from composer.servers import spawn
        child = spawn([sys.executable, "-c", "import time; time.sleep(600)"],
                      Path({str(tmp_path / "orphan.log")!r}), die_with_parent=True)
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    starter = subprocess.Popen(_python(script), stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    pid = int(starter.stdout.readline())
    assert alive(pid)
    starter.kill()
    starter.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, "the child outlived its starter"
        time.sleep(0.05)


def test_stop_group_asks_the_leader_then_stops_the_rest(tmp_path: Path) -> None:
    """The leader stops on SIGTERM; a child of it that ignores SIGTERM is killed."""
    log = tmp_path / "g.log"
    leader = textwrap.dedent(
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {STUBBORN!r}])
        time.sleep(600)
        """
    )
    proc = spawn(_python(leader), log)
    _wait_for(log, "ready")
    assert stop_group(proc, grace=10, signal_wait=1)
    assert proc.returncode == -signal.SIGTERM
    assert not group_alive(proc.pid)


def test_stop_group_of_a_group_already_gone_needs_no_signal(tmp_path: Path) -> None:
    proc = spawn(_python("pass"), tmp_path / "e.log")
    proc.wait(timeout=30)
    assert not stop_group(proc, grace=5, signal_wait=1)


def test_kill_group_kills_every_process_of_it(tmp_path: Path) -> None:
    log = tmp_path / "kg.log"
    leader = textwrap.dedent(
        f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", {STUBBORN!r}]).wait()
        """
    )
    proc = spawn(_python(leader), log)
    _wait_for(log, "ready")
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while group_alive(proc.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_process_s_cpu_seconds_are_read_while_it_lives() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # (busy: the clock ticks are 10 ms)
        pass
    after = cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.1
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert cpu_seconds(child.pid) is None  # (reaped: gone)
