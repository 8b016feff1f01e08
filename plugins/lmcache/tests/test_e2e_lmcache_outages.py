"""A `lmcache server` that goes away under a running engine (real vLLM, real servers).

The ``lmcache-killer`` test node (``kvc_lmcache_faults.py``) SIGKILLs a server
from inside EngineCore when round 2's first request arrives: between rounds
(then holding the scheduler 2 s, so the kill is known before round 2 is
scheduled), or just before the lmcache node's lookups of round 2 go out (they
are sent to a dead server and their acks awaited), or between rounds with a
server started again where it was. Rounds repeat the same prompts, so round 2
would be served by LMCache. A dead store is no fault (the node raises
``Unavailable``): under every ``on_error`` policy every request completes with
the tokens of a run without a connector (same thread binding), none waits
anywhere near ``mq_timeout``, the node stays on, reports the outage, resumes
when the server is back, and the engine shuts down by itself.

The chaos engine (``lmcache-chaos``; vLLM's scheduler and worker in their own
processes, as served) replays a slice of the Mooncake conversation trace, six
requests in flight per round, and kills the node's own server three times as
a round's lookups go out; the node restarts it each time. Tokens equal a plain
engine's, no request stalls, every KV block comes back, and after each return
the repeated prompts are served again; the test prints each outage's restart
and resume times.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from kvc_lmcache.server_process import ServerSettings, is_lmcache_server, start_server

from composer import discover, kv_transfer_config, load_pipeline
from composer.servers import alive, stop_process
from composer.testing import kept as kept_tokens
from composer.testing.engine import (
    EngineResult,
    EngineSpec,
    SharedRuns,
    plugin_env,
    run_engine,
)
from composer.testing.tiny_model import build_tiny_model, make_prompts, trace_prompts

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
PROMPTS = make_prompts(3, words=120, seed=43)
MQ_TIMEOUT = 30.0
#: 12 requests of the Mooncake conversation trace.
SLICE = trace_prompts(12, str(build_tiny_model()))
#: Two rounds of six requests each, all in flight together.
A, B = SLICE[:6], SLICE[6:]
#: After the last outage, one request and then another: by the second's lookup
#: every block lent before the first must be back (the first's own may still
#: be held for its save: saves finish asynchronously, reported in a later step).
SENTINELS = [[PROMPTS[0]], [PROMPTS[1]]]
OUTAGES = 3
#: A, B (saved), A, B (served), then per outage: A with the server killed as its
#: lookups go out (all misses, saves skipped), B (the restarted, empty server:
#: computed and saved), A (computed and saved), B (served again).
CHAOS_ROUNDS = [A, B, A, B, *[A, B, A, B] * OUTAGES, *SENTINELS]
KILL_ROUNDS = [4 + 4 * i for i in range(OUTAGES)]
#: The plain reference of each chaos round: the same batch, without a connector.
CHAOS_PLAIN = [A, B, *SENTINELS]
#: The references: three rounds of PROMPTS, and the chaos batches (the shared ``plain_llama``).
PLAIN_LLAMA_ROUNDS = [PROMPTS] * 3
BETWEEN: dict[str, Any] = {"at_request": len(PROMPTS) + 1, "settle_s": 2.0}
#: Killed as round 2's lookups go out: LMCache sends them to a dead server and
#: polls for their acks, which would take mq_timeout.
IN_FLIGHT: dict[str, Any] = {"at_request": len(PROMPTS) + 1}
#: Killed between rounds, then a server started where it was (empty).
RESTART: dict[str, Any] = {**BETWEEN, "settle_s": 5.0, "restart_chunk_size": BLOCK}


def _kv(
    report: Path,
    killer: dict[str, Any],
    on_error: str,
    server: dict[str, Any],
    plugin: str = "lmcache-killer",
) -> Any:
    import kvc_lmcache_faults

    pipeline = {
        "version": 1,
        "annotate_outputs": True,
        "nodes": {
            "kept": kept_tokens.node(),
            "killer": {
                "plugin": plugin,
                "needs": ["lmcache"],
                "config": {"report": str(report), **killer},
            },
            "lmcache": {
                "plugin": "lmcache",
                "on_error": on_error,
                "config": {
                    "chunk_size": BLOCK,
                    "server": {"mq_timeout": MQ_TIMEOUT, **server},
                },
            },
        },
        "load_order": ["killer", "lmcache"],
    }
    return kv_transfer_config(
        load_pipeline(pipeline, registry=discover(extra=[kvc_lmcache_faults, kept_tokens]))
    )


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, plain_llama: SharedRuns
) -> Iterator[dict[str, Any]]:
    model = str(build_tiny_model())
    state = tmp_path_factory.mktemp("lmcache-state")
    env = {
        "KVC_LMCACHE_STATE_DIR": str(state),
        **plugin_env(HERE, "kvc_lmcache_faults", kept_tokens.MODULE),
    }
    out: dict[str, Any] = {"state": state, "servers": []}

    def run(
        name: str, rounds: int | list[list[Any]], kv: Any, in_process: bool = True
    ) -> EngineResult:
        spec = EngineSpec(
            model=model,
            rounds=[PROMPTS] * rounds if isinstance(rounds, int) else rounds,
            kv_transfer_config=kv,
            env=env,
            max_tokens=8,
            enforce_eager=True,
            in_process=in_process,
        )
        return run_engine(spec)

    def given() -> tuple[dict[str, Any], int | None]:
        """A server started by the test: its config, and its pid for the killer."""
        log = tmp_path_factory.mktemp("server") / "server.log"
        info = start_server(ServerSettings(chunk_size=BLOCK, l1_size_gb=0.25), log)
        out["servers"].append(info)
        return {"url": info.url, "http_url": info.http_url}, info.pid

    def owned() -> tuple[dict[str, Any], int | None]:
        return {}, None

    def report(name: str) -> Path:
        return tmp_path_factory.mktemp(name) / "report"

    try:
        out["plain"] = plain_llama(PLAIN_LLAMA_ROUNDS)
        out["chaos-plain"] = plain_llama(CHAOS_PLAIN)
        cases = {
            "recompute-between": (BETWEEN, "recompute", given, 3),
            "fail-between": (BETWEEN, "fail", given, 3),
            "recompute-in-flight": (IN_FLIGHT, "recompute", owned, 2),
            "recompute-restarted": (RESTART, "recompute", given, 3),
        }
        for name, (killer, on_error, server, rounds) in cases.items():
            path = report(name)
            config, pid = server()
            if name == "recompute-restarted":
                # LMCache's heartbeat brings it back (re-registering the KV caches).
                config["heartbeat_interval"] = 2.0
            if name == "recompute-in-flight":
                config["restarts"] = 0  # stays down: the chaos engine restarts
            out[name] = run(name, rounds, _kv(path, {**killer, "pid": pid}, on_error, config))
            out[f"{name}/report"] = _reports(path)
        restarted = out["recompute-restarted/report"]["scheduler"]["restarted_pid"]
        out["restarted_pid"] = restarted
        out["restarted_port"] = out["servers"][-1].port
        path = report("chaos")
        chaos = {"kill_at": [6 * r + 1 for r in KILL_ROUNDS]}
        chaos["resume_by"] = [6 * (r + 1) + 1 for r in KILL_ROUNDS]
        kv = _kv(path, chaos, "recompute", {"heartbeat_interval": 2.0}, plugin="lmcache-chaos")
        # As served: scheduler and worker in their own processes, each with its
        # lmcache node, its watcher and its LMCache adapter (its plain reference
        # runs in one process, with the same two OpenMP threads).
        out["chaos"] = run("chaos", CHAOS_ROUNDS, kv, in_process=False)
        out["chaos/report"] = _reports(path)
        yield out
    finally:
        for info in out["servers"]:
            assert info.pid is not None
            stop_process(info.pid)
        restarted = out.get("restarted_pid")
        if restarted and is_lmcache_server(restarted, out["restarted_port"]):
            stop_process(restarted)


def _reports(path: Path) -> dict[str, Any]:
    return {
        role: json.loads(Path(f"{path}.{role}.json").read_text())
        for role in ("scheduler", "worker")
    }


STAYS_DOWN = ["recompute-between", "fail-between", "recompute-in-flight"]
SURVIVING = [*STAYS_DOWN, "recompute-restarted"]


def _served(result: EngineResult, r: int) -> list[str | None]:
    return [
        (x.kv_transfer_params or {}).get("kv_composer", {}).get("served_by")
        for x in result.rounds[r]
    ]


@pytest.mark.parametrize("name", SURVIVING)
def test_every_request_completes_with_the_tokens_of_a_plain_run(
    runs: dict[str, Any], name: str
) -> None:
    result = runs[name]
    for r in range(len(result.rounds)):
        assert result.tokens(r) == runs["plain"].tokens(r), f"round {r}"


@pytest.mark.parametrize("name", [*SURVIVING, "chaos"])
def test_what_the_node_is_said_to_have_served_arrived(runs: dict[str, Any], name: str) -> None:
    # Request by request, also for loads that met the dead server: served_by and
    # tokens are what vLLM kept (``kept-tokens``), not what was planned.
    wrong, _ = kept_tokens.reported_vs_kept(runs[name].rounds)
    assert not wrong, f"(round, request, reported, kept): {wrong}"
    # Node by node: the settled counters on /metrics add up to those requests'.
    miscounted = kept_tokens.counted_vs_reported(runs[name].rounds, runs[name].metrics)
    assert not miscounted, f"node: (counted on /metrics, reported): {miscounted}"


@pytest.mark.parametrize("name", STAYS_DOWN)
def test_no_request_waits_out_the_message_queue_timeout(runs: dict[str, Any], name: str) -> None:
    report = runs[f"{name}/report"]["scheduler"]
    assert report["killed_at"] is not None, "the server was never killed"
    latency = report["latency"]
    assert len(latency) == len(runs[name].rounds) * len(PROMPTS)
    # A functional hang check: a lookup or transfer waiting on the dead server
    # would take mq_timeout.
    assert max(latency.values()) < MQ_TIMEOUT / 2, latency


def test_round_one_is_saved_and_round_two_is_not_served_by_a_dead_server(
    runs: dict[str, Any],
) -> None:
    for name in ("recompute-between", "fail-between"):
        result = runs[name]
        assert _served(result, 0) == [None] * len(PROMPTS)
        for r in (1, 2):
            assert _served(result, r) == [None] * len(PROMPTS), (name, r)
            assert [x.cached_tokens for x in result.rounds[r]] == [0] * len(PROMPTS)


@pytest.mark.parametrize("name", STAYS_DOWN)
@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_the_node_reports_the_dead_server(runs: dict[str, Any], name: str, role: str) -> None:
    report = runs[f"{name}/report"][role]
    assert report["server_alive"] is False and report["gauge_server_alive"] == 0
    assert report["down_events"] == 1 and report["server_outages"] == 1
    killed_at = runs[f"{name}/report"]["scheduler"]["killed_at"]
    # Measured here: 0.1-0.6 s. The bound only says detection does not wait for
    # LMCache's own heartbeat or mq_timeout (a loaded host may starve the thread).
    assert 0 <= report["down_since"] - killed_at < MQ_TIMEOUT / 2, report


@pytest.mark.parametrize("name", STAYS_DOWN)
def test_a_dead_server_is_no_fault_under_any_policy(runs: dict[str, Any], name: str) -> None:
    for role, report in runs[f"{name}/report"].items():
        # Lookups miss, loads are recomputed, saves are skipped: counted as the
        # store away, never as errors, and the node stays on (also under fail).
        assert report["errors"] == 0, (role, report)
        assert report["unavailable"] > 0 and report["disabled"] is False, (role, report)
    lines = [line for line in runs[name].log.splitlines() if "node's store is away" in line]
    assert len(lines) == 2, "one warning per process and chain half"
    assert "node's store is back" not in runs[name].log


@pytest.mark.parametrize("name", STAYS_DOWN)
def test_the_engine_shuts_down_by_itself(runs: dict[str, Any], name: str) -> None:
    result = runs[name]
    assert result.clean_exit, "the engine's processes needed a signal to stop"
    lines = [line for line in result.log.splitlines() if "lmcache node shut down" in line]
    assert len(lines) == 2, "one shutdown per process (worker, scheduler)"
    for line in lines:
        assert "server_alive=False" in line, line
        seconds = float(line.split("seconds=")[1].split()[0])
        # A functional hang check: talking to the dead server would take mq_timeout.
        assert seconds < MQ_TIMEOUT / 2, line


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_server_back_where_it_was_is_used_again(runs: dict[str, Any], role: str) -> None:
    result = runs["recompute-restarted"]
    report = runs["recompute-restarted/report"][role]
    assert report["down_events"] == 1 and report["server_outages"] == 1
    # LMCache's heartbeat re-registered with the new server; the node resumed
    # before round 2 and was never switched off.
    assert report["server_alive"] is True and report["gauge_server_alive"] == 1, report
    assert report["errors"] == 0 and report["disabled"] is False, report
    # The killer held the scheduler until the node resumed: no call met the outage.
    assert report["unavailable"] == 0 and "node's store is away" not in result.log
    # The restarted server is empty: round 2 computes and saves to it, round 3
    # is served from it.
    assert _served(result, 1) == [None] * len(PROMPTS)
    assert _served(result, 2) == ["lmcache"] * len(PROMPTS)
    lines = [line for line in result.log.splitlines() if "lmcache node shut down" in line]
    assert len(lines) == 2 and all("server_alive=True" in line for line in lines), lines
    assert result.clean_exit


def test_no_server_or_state_is_left_behind(runs: dict[str, Any]) -> None:
    for info in runs["servers"]:
        assert not alive(info.pid), "a killed server still runs"
    # Started inside EngineCore: gone with it (PR_SET_PDEATHSIG).
    assert runs["restarted_pid"] is not None
    assert not is_lmcache_server(runs["restarted_pid"], runs["restarted_port"])
    # The chaos engine's own server, started again three times: the last one
    # stopped with the engine, the killed ones gone.
    for outage in runs["chaos/report"]["scheduler"]["outages"]:
        for pid in (outage["killed_pid"], outage["restarted_pid"]):
            assert not alive(pid), outage
    state: Path = runs["state"]
    assert list(state.glob("*.log")), "the in-flight case started no server"
    assert not list(state.glob("*.json")), "an owned server's state outlived its engine"


# -- chaos: the node's own server killed three times under load --------------- #


def _fraction(result: EngineResult, r: int) -> float:
    """Prompt tokens the lmcache node served in round ``r``, over its prompt tokens."""
    served = sum(x.cached_tokens for x in result.rounds[r])
    return served / sum(x.prompt_tokens for x in result.rounds[r])


def test_chaos_tokens_equal_a_plain_engine_in_every_round(runs: dict[str, Any]) -> None:
    plain = runs["chaos-plain"]
    for r, prompts in enumerate(CHAOS_ROUNDS):
        reference = plain.tokens(CHAOS_PLAIN.index(prompts))
        assert runs["chaos"].tokens(r) == reference, f"round {r}"


def test_chaos_no_request_is_lost_or_stalled(runs: dict[str, Any]) -> None:
    result, report = runs["chaos"], runs["chaos/report"]["scheduler"]
    assert [len(r) for r in result.rounds] == [len(p) for p in CHAOS_ROUNDS]
    latency = report["latency"]
    assert len(latency) == sum(len(p) for p in CHAOS_ROUNDS)
    # A functional hang check: a wait on a dead server would take mq_timeout.
    slow = {r: round(s, 2) for r, s in latency.items() if s >= MQ_TIMEOUT / 2}
    assert not slow, f"requests that waited on a dead server: {slow}; outages: {report['outages']}"
    assert result.clean_exit


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_chaos_a_request_sent_in_an_outage_is_ended_by_the_node(
    runs: dict[str, Any], role: str
) -> None:
    # Sent once the node has noticed each outage, while the restart is under
    # way (a store begun before LMCache was degraded sends its commit then).
    late = runs["chaos/report"][role]["late_waits"]
    assert len(late) == OUTAGES, late
    for wait in late:
        assert wait["ended"] and wait["seconds"] < MQ_TIMEOUT / 2, late
        assert wait["error"] and "is down" in wait["error"], late
        assert wait["node_resumed"] is False, late


def test_chaos_every_kv_block_comes_back(runs: dict[str, Any]) -> None:
    # vLLM's free blocks, sampled at each request's first lookup.
    free = runs["chaos/report"]["scheduler"]["free_blocks"]
    first_sentinel = runs["chaos"].rounds[-2][0]
    its_own = -(-(first_sentinel.prompt_tokens + 8) // BLOCK)
    at_round = [free[i] for i in range(0, len(free) - 2, len(A))]
    assert free[0] - its_own <= free[-1] <= free[0], (
        f"{free[0] - free[-1]} KV blocks not back (at most {its_own} may still be held "
        f"for the first sentinel's save); free at each round's start: {at_round}"
    )


def test_chaos_the_node_restarts_its_server_and_resumes_each_time(
    runs: dict[str, Any], figures: Callable[[str], None]
) -> None:
    report = runs["chaos/report"]["scheduler"]
    outages = report["outages"]
    assert len(outages) == OUTAGES
    pids = [o["killed_pid"] for o in outages] + [outages[-1]["restarted_pid"]]
    assert len(set(pids)) == OUTAGES + 1, "a new server process after each kill"
    for o in outages:
        assert o["resumed_at"] is not None, o
        assert o["killed_at"] < o["back_at"] <= o["resumed_at"], o
    # Restarted by whichever chain half's watcher noticed first (the other finds it back).
    reports = runs["chaos/report"].values()
    assert sum(r["gauges"]["server_restarts"] for r in reports) == OUTAGES
    assert report["alive_at_last_lookup"] is True and report["disabled"] is False
    for role, r in runs["chaos/report"].items():
        assert r["totals"]["errors"] == 0 and r["totals"]["unavailable"] > 0, (role, r)
    # Each outage logged where it starts and where it ends, in each chain half.
    log = runs["chaos"].log
    assert log.count("node's store is away") == log.count("node's store is back") >= OUTAGES
    figures(
        "LMCache server outages (s): "
        + "; ".join(
            f"restarted {o['back_at'] - o['killed_at']:.2f}, resumed "
            f"{o['resumed_at'] - o['back_at']:.2f} later"
            for o in outages
        )
    )


def test_chaos_the_served_fraction_recovers_after_each_outage(
    runs: dict[str, Any], figures: Callable[[str], None]
) -> None:
    result = runs["chaos"]
    before = _fraction(result, 3)  # B, repeated before any outage
    assert before > 0.5
    # What an outage costs: requests served less than before any outage (rounds
    # 2 and 3 served A and B), from the kill until B is served again.
    baseline = {0: result.rounds[2], 1: result.rounds[3]}
    cost = [
        sum(
            x.cached_tokens < baseline[(r - kill) % 2][i].cached_tokens
            for r in range(kill, kill + 4)
            for i, x in enumerate(result.rounds[r])
        )
        for kill in KILL_ROUNDS
    ]
    figures(f"requests computed that the tier had served before, per outage: {cost}")
    for kill in KILL_ROUNDS:
        assert _served(result, kill) == [None] * len(A), "a dead server serves nothing"
        # The restarted server is empty: B is computed and saved again, then served.
        assert _fraction(result, kill + 3) == before, kill
