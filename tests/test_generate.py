"""``kvc trace generate``: a seeded synthetic trace in the shared traces' format, with
tenants, sessions whose turns repeat their prefix, and think times by kind."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from composer.cli import main
from composer.simulate.generate import TraceShape, generate
from composer.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, read_trace

SMALL = TraceShape(requests=600, tenants=3, seed=7)


def _sessions(trace: list[TraceRequest]) -> dict[tuple[str, int], list[TraceRequest]]:
    """Requests by (tenant, first id past the tenant's system prompt): a session each."""
    skip = SMALL.system_tokens // MOONCAKE_BLOCK_TOKENS
    out: dict[tuple[str, int], list[TraceRequest]] = defaultdict(list)
    for r in trace:
        out[r.tenant, r.hash_ids[skip]].append(r)
    return out


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    assert generate(SMALL) == generate(SMALL)
    assert generate(SMALL) != generate(replace(SMALL, seed=8))


def test_it_reads_back_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gen.jsonl"
    code = main(
        ["trace", "generate", str(path), "--requests", "600", "--tenants", "3", "--seed", "7"]
    )
    assert code == 0, capsys.readouterr().err
    assert read_trace(path) == generate(SMALL)
    assert "600 requests, 3 tenants" in capsys.readouterr().err


def test_requests_arrive_in_order_each_of_a_tenant() -> None:
    trace = generate(SMALL)
    assert len(trace) == SMALL.requests
    stamps = [r.timestamp_ms for r in trace]
    assert stamps == sorted(stamps)
    tenants = {r.tenant for r in trace}
    assert tenants <= {f"tenant-{t}" for t in range(3)} and len(tenants) == 3
    # The first tenant is the busiest (shares 1, 1/2, 1/3).
    counts = sorted(((sum(r.tenant == t for r in trace), t) for t in tenants), reverse=True)
    assert counts[0][1] == "tenant-0"


def test_a_sessions_next_turn_repeats_its_prompt_and_its_tenants_system_prompt() -> None:
    trace = generate(SMALL)
    system = SMALL.system_tokens // MOONCAKE_BLOCK_TOKENS
    by_tenant: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for turns in _sessions(trace).values():
        for before, after in zip(turns, turns[1:], strict=False):
            whole = before.input_length // MOONCAKE_BLOCK_TOKENS
            assert after.hash_ids[:whole] == before.hash_ids[:whole]
            assert after.input_length > before.input_length + before.output_length
        by_tenant[turns[0].tenant].add(turns[0].hash_ids[:system])
    assert all(len(prefixes) == 1 for prefixes in by_tenant.values())
    assert len({next(iter(p)) for p in by_tenant.values()}) == len(by_tenant)


def test_agents_come_back_sooner_than_chats() -> None:
    def gaps(share: float) -> float:
        trace = generate(replace(SMALL, agent_share=share))
        return statistics.median(
            b.timestamp_ms - a.timestamp_ms
            for turns in _sessions(trace).values()
            for a, b in zip(turns, turns[1:], strict=False)
        )

    assert gaps(1.0) * 5 < gaps(0.0)


def test_no_prompt_passes_the_longest_context() -> None:
    shape = replace(SMALL, context_tokens=20000, max_context_tokens=30000)
    assert max(r.input_length for r in generate(shape)) < 30000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "0"], "--requests must be >= 1"),
        (["--tenants", "0"], "--tenants must be >= 1"),
        (["--session-rate", "0"], "--session-rate must be a finite number > 0"),
        (["--session-rate", "inf"], "--session-rate must be a finite number > 0"),
        (["--agent-share", "1.5"], "--agent-share must be between 0 and 1"),
        (["--system-tokens", "-1"], "--system-tokens and --context-tokens must be >= 0"),
        (["--context-tokens", "-1"], "--system-tokens and --context-tokens must be >= 0"),
        (["--max-context-tokens", "512"], "--max-context-tokens must be > --system-tokens"),
        (["--decode-s", "-1"], "--decode-s must be a finite number >= 0"),
        (["--requests", "x"], "invalid int value"),
    ],
)
def test_every_bad_value_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = main(["trace", "generate", str(tmp_path / "t.jsonl"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "t.jsonl").exists()
