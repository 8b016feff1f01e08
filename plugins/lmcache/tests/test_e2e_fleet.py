"""One KV cache for a fleet: two engines, two `lmcache server`s, one real Valkey (real vLLM).

As two hosts would run them: engine A and engine B each start their own
`lmcache server` (its L1 is that "host's" memory) with the same Valkey as L2
(``server.l2: [{type: resp, ...}]``). vLLM's prefix cache is off and B's
server starts empty, so a hit in B can only come from Valkey. Every engine
has the same VLLM_CPU_OMP_THREADS_BIND, so tokens compare exactly with a
plain engine's.

* A (``offload-cpu`` in front, ``longest_hit``, annotated) computes P twice:
  round 1 is served by the CPU tier in front; Valkey now holds P.
* Tenants (vLLM's ``cache_salt``) apart through the shared Valkey: A also
  computes X under salt "alice". B's round 1 sends X under "bob": nothing is
  served (Valkey holds X only under alice's salt), and B computes and saves it;
  round 2 sends X under "alice": served from Valkey, A's.
* B computes nothing of P: round 0 is served from Valkey. Then, from inside
  B's scheduler (the ``fleet-faults`` node), Valkey is SIGKILLed while round
  3 (Q) is being computed and saved; round 4 repeats P with B's L1 emptied, so
  only the dead Valkey could serve it: it is recomputed. Valkey is started
  again (empty) before round 5 (R, computed and saved to it); round 6 repeats
  R with B's L1 emptied again: served from Valkey, vLLM never restarted.
  Rounds 7-10 do it all again (S computed while Valkey dies, R not served,
  T saved to the restarted Valkey and served from it): an outage and a
  return, twice, each return's reconnect timed. Two last rounds of one
  request each show every KV block lent back; no request of B waited
  anywhere near ``mq_timeout``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import valkey
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from fleet_checks import blocks_not_back, recomputed, served, stalled

from composer import discover, kv_transfer_config, load_pipeline
from composer.servers import ValkeyServer, valkey_server
from composer.testing.engine import (
    EngineResult,
    EngineSpec,
    Prompt,
    SharedRuns,
    plugin_env,
    run_engine,
)
from composer.testing.tiny_model import build_tiny_model, make_prompts

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
N = 3
MAX_TOKENS = 8
MQ_TIMEOUT = 30.0


def _prompts(n: int, seed: int) -> list[Prompt]:
    return list(make_prompts(n, words=120, seed=seed))


P = _prompts(N, 61)  # computed by A only
Q = _prompts(N, 62)  # computed by B while Valkey is killed
R = _prompts(N, 63)  # computed by B after Valkey is back
S = _prompts(N, 64)  # computed by B while Valkey is killed again
T = _prompts(N, 65)  # computed by B after Valkey is back again
X = _prompts(N, 67)  # computed by A under alice's salt only


def _salted(prompts: list[Prompt], salt: str) -> list[Prompt]:
    return [{"prompt": p, "cache_salt": salt} for p in prompts]


X_ALICE, X_BOB = _salted(X, "alice"), _salted(X, "bob")
#: Two last rounds of one request each (see ``fleet_checks.blocks_not_back``).
SENTINELS = [[p] for p in _prompts(2, 66)]
A_ROUNDS = [P, P, X_ALICE]
B_ROUNDS = [P, X_BOB, X_ALICE, Q, P, R, R, S, R, T, T, *SENTINELS]
#: The reference: B's rounds without a connector (the shared ``plain_llama`` engine).
PLAIN_LLAMA_ROUNDS = B_ROUNDS
#: The rounds in which Valkey is killed (each followed by its return, see the module).
OUTAGE_ROUNDS = (3, 7)
#: Request ordinal (1-based) -> what the fleet-faults node does first.
B_ACTIONS = {
    key: actions
    for o in OUTAGE_ROUNDS
    for key, actions in {
        # SIGKILLed from a timer while round o's requests are looked up, computed, saved.
        str(o * N + 1): ["kill_valkey_in_flight"],
        str((o + 1) * N + 1): ["wait_valkey_dead", "clear_l1"],
        str((o + 2) * N + 1): ["restart_valkey", "wait_l2_connected", "settle"],
        str((o + 3) * N + 1): ["clear_l1"],
    }.items()
}


def _lmcache(valkey_server: ValkeyServer) -> dict[str, Any]:
    return {
        "plugin": "lmcache",
        "config": {
            "chunk_size": BLOCK,
            "server": {
                "l1_size_gb": 0.25,
                "mq_timeout": MQ_TIMEOUT,
                "l2": [
                    {
                        "type": "resp",
                        "host": valkey_server.host,
                        "port": valkey_server.port,
                        "num_workers": 2,
                    }
                ],
            },
        },
    }


def _kv_a(vk: ValkeyServer) -> dict[str, Any]:
    pipeline = {
        "version": 1,
        "annotate_outputs": True,
        "load_policy": "longest_hit",
        "nodes": {
            "cpu": {"plugin": "offload-cpu", "config": {"capacity": "64MiB"}},
            "lmcache": _lmcache(vk),
        },
        "load_order": ["cpu", "lmcache"],
    }
    return kv_transfer_config(load_pipeline(pipeline))


def _kv_b(vk: ValkeyServer, report: Path) -> dict[str, Any]:
    import kvc_fleet_faults

    pipeline = {
        "version": 1,
        "annotate_outputs": True,
        "nodes": {
            "faults": {
                "plugin": "fleet-faults",
                "needs": ["lmcache"],
                "config": {
                    "report": str(report),
                    "actions": B_ACTIONS,
                    "valkey_pid": vk.pid,
                    "valkey_port": vk.port,
                    "valkey_workdir": str(vk.workdir),
                    "delay_s": 0.02,
                },
            },
            "lmcache": {**_lmcache(vk), "on_error": "recompute"},
        },
        "load_order": ["faults", "lmcache"],
    }
    return kv_transfer_config(load_pipeline(pipeline, registry=discover(extra=[kvc_fleet_faults])))


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, plain_llama: SharedRuns
) -> Iterator[dict[str, Any]]:
    model = str(build_tiny_model())
    state = tmp_path_factory.mktemp("lmcache-state")
    env = {"KVC_LMCACHE_STATE_DIR": str(state), **plugin_env(HERE, "kvc_fleet_faults")}
    out: dict[str, Any] = {}

    def run(rounds: list[list[Prompt]], kv: dict[str, Any] | None) -> EngineResult:
        return run_engine(
            EngineSpec(
                model=model,
                rounds=rounds,
                kv_transfer_config=kv,
                env=env,
                max_tokens=MAX_TOKENS,
                enforce_eager=True,
                in_process=True,
            )
        )

    restarted: list[int] = []
    report = tmp_path_factory.mktemp("fleet-b") / "report"
    try:
        with valkey_server(tmp_path_factory.mktemp("valkey")) as vk:
            client = valkey.Valkey(host=vk.host, port=vk.port)
            out["plain"] = plain_llama(B_ROUNDS)
            out["a"] = run(A_ROUNDS, _kv_a(vk))
            out["keys_after_a"] = client.dbsize()
            client.close()
            out["b"] = run(B_ROUNDS, _kv_b(vk, report))
            out["b/report"] = json.loads(Path(f"{report}.scheduler.json").read_text())
            out["b/worker"] = json.loads(Path(f"{report}.worker.json").read_text())
            restarted = out["b/report"]["restarted_pids"]
            client = valkey.Valkey(host=vk.host, port=vk.port)
            out["keys_after_b"] = client.dbsize()
            client.close()
            out["valkey_killed"] = vk.proc is not None and vk.proc.poll() is not None
            yield out
    finally:
        for pid in restarted:
            _stop_valkey(pid)


def _stop_valkey(pid: int) -> None:
    """Stop a valkey-server the fleet-faults node started (only if it is one)."""
    import signal

    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"valkey-server" in cmdline:
        os.kill(pid, signal.SIGKILL)


def test_tokens_equal_a_plain_engine_in_every_round(runs: dict[str, Any]) -> None:
    plain = runs["plain"]
    # The plain engine ran B's rounds; A's are P twice (B's round 0), then X (B's 1).
    assert plain.tokens(0) == plain.tokens(4) and plain.tokens(1) == plain.tokens(2)
    for r, b in enumerate((0, 0, 1)):
        assert runs["a"].tokens(r) == plain.tokens(b), f"A round {r}"
    for r in range(len(B_ROUNDS)):
        assert runs["b"].tokens(r) == plain.tokens(r), f"B round {r}"


def test_a_saves_its_prompts_to_valkey(runs: dict[str, Any]) -> None:
    # One key per LMCache chunk of every prompt A computed.
    assert runs["keys_after_a"] >= sum(r.prompt_tokens // BLOCK for r in runs["a"].rounds[0]), runs[
        "keys_after_a"
    ]


def test_the_cpu_tier_in_front_serves_a_repeat_on_the_same_engine(runs: dict[str, Any]) -> None:
    assert served(runs["a"], 0) == [None] * N
    assert served(runs["a"], 1) == ["cpu"] * N


@pytest.mark.parametrize("r", [0, 2])
def test_b_serves_from_valkey_what_only_a_computed(runs: dict[str, Any], r: int) -> None:
    # Round 2: X under alice's salt, as A computed it (and after B computed X
    # under bob's: nothing of bob's is served to alice either).
    assert served(runs["b"], r) == ["lmcache"] * N
    for result in runs["b"].rounds[r]:
        # Every whole chunk of the prompt; the last partial one is computed.
        assert result.cached_tokens == (result.prompt_tokens - 1) // BLOCK * BLOCK, result


def test_no_kv_crosses_tenants_through_the_shared_valkey(runs: dict[str, Any]) -> None:
    # Round 1: the same prompts as A's alice round, under bob's salt: Valkey holds
    # them, for alice only.
    assert served(runs["b"], 1) == [None] * N
    assert [r.cached_tokens for r in runs["b"].rounds[1]] == [0] * N


def test_valkey_was_killed_in_flight_and_restarted_by_the_faults_node(
    runs: dict[str, Any], figures: Callable[[str], None]
) -> None:
    done = runs["b/report"]["done"]
    actions = [a for _, a, _ in done]
    assert actions.count("kill_valkey_in_flight") == 2
    assert actions.count("restart_valkey") == 2 and actions.count("clear_l1") == 4
    assert runs["b/report"]["l1_not_emptied"] == []  # each clear left L1 empty
    assert runs["valkey_killed"]
    assert len(set(runs["b/report"]["restarted_pids"])) == 2
    # Time to resume: from the restarted Valkey answering PING to the lmcache
    # server's RESP adapter connected to it again.
    at = {(ordinal, action): t for ordinal, action, t in done}
    resumed = [
        at[(ordinal, "wait_l2_connected")] - at[(ordinal, "restart_valkey")]
        for ordinal, action, _ in done
        if action == "restart_valkey"
    ]
    # Requests computed that a Valkey that never went away would have served,
    # from the kill to the round after the return (then served again).
    cost = [recomputed(runs["b"], B_ROUNDS, range(o, o + 3)) for o in OUTAGE_ROUNDS]
    figures(
        "Valkey behind LMCache, per outage: "
        + "; ".join(
            f"reconnected {s:.2f} s after the restarted Valkey answered, {c} requests recomputed"
            for s, c in zip(resumed, cost, strict=True)
        )
    )
    assert len(resumed) == 2 and all(s >= 0 for s in resumed)


@pytest.mark.parametrize("outage", OUTAGE_ROUNDS)
def test_nothing_is_served_from_a_dead_valkey(runs: dict[str, Any], outage: int) -> None:
    # The round after the kill repeats earlier prompts with B's L1 emptied: only
    # Valkey held them.
    assert served(runs["b"], outage + 1) == [None] * N
    assert [r.cached_tokens for r in runs["b"].rounds[outage + 1]] == [0] * N


def test_the_node_counts_the_l2_errors(runs: dict[str, Any]) -> None:
    # Both of B's processes read the same server's metrics at shutdown.
    for report in (runs["b/report"], runs["b/worker"]):
        gauges = report["gauges"]
        assert gauges["l2_adapters"] == 1
        # The lookups of the round after each kill (Valkey surely dead by then)
        # failed, and whatever part of the kill's round met it; the saves of the
        # round after reached the restarted one.
        assert gauges["l2_errors"] > 0, gauges
        assert 0 < gauges["l2_stored_chunks"] <= gauges["l2_store_chunks"], gauges
        # Rounds 0, 2, 6 and 10 were served from Valkey.
        assert gauges["l2_hit_tokens"] >= 4 * BLOCK * N, gauges


def test_the_node_counts_the_tokens_it_loaded(runs: dict[str, Any]) -> None:
    # LMCache's connector keeps no count: the node counts the retrieves it was
    # asked for, once vLLM learns they finished, less their failed blocks.
    served = [
        r.cached_tokens
        for rnd in runs["b"].rounds
        for r in rnd
        if (r.kv_transfer_params or {}).get("kv_composer", {}).get("served_by") == "lmcache"
    ]
    assert len(served) == 4 * N  # rounds 0, 2, 6 and 10
    assert runs["b/worker"]["totals"]["tokens_loaded"] == sum(served)
    assert runs["b/report"]["totals"]["tokens_loaded"] == 0  # loads happen in the worker


@pytest.mark.parametrize("outage", OUTAGE_ROUNDS)
def test_hits_resume_once_valkey_is_back_without_restarting_vllm(
    runs: dict[str, Any], outage: int
) -> None:
    assert served(runs["b"], outage + 2) == [None] * N
    assert served(runs["b"], outage + 3) == ["lmcache"] * N
    assert runs["keys_after_b"] > 0


def test_no_request_of_b_is_lost_or_stalls(runs: dict[str, Any]) -> None:
    latency = runs["b/report"]["latency"]
    assert len(latency) == sum(len(rnd) for rnd in B_ROUNDS)
    # A functional hang check: a wait on a dead Valkey (or on the lmcache server
    # waiting on it) lasts mq_timeout.
    slow = stalled(latency, MQ_TIMEOUT)
    assert not slow, f"requests that waited on a dead store: {slow}"
    assert runs["b"].clean_exit


def test_every_kv_block_of_b_comes_back(runs: dict[str, Any]) -> None:
    free = runs["b/report"]["free_blocks"]
    assert len(free) == sum(len(rnd) for rnd in B_ROUNDS)
    problem = blocks_not_back(free, runs["b"], BLOCK, MAX_TOKENS)
    assert problem is None, problem
