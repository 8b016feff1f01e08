"""offload-cpu inside real vLLM (CPU build, tiny local model, prefix cache off).

One module-scoped set of engine runs: a plain engine (no connector) as the
reference (the session's shared ``plain_llama`` engine), the pipeline
``{cpu: offload-cpu}`` (sync loads), the same with a 4 GiB pool, and the same
with async loads and checksums while a test node corrupts every other stored
block. All runs use the same
VLLM_CPU_OMP_THREADS_BIND, so token comparisons are not thread-count noise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from offload_cpu_e2e_plugins import tier_pipeline

from composer.testing import kept  # noqa: E402
from composer.testing.engine import (  # noqa: E402
    EngineResult,
    EngineSpec,
    SharedRuns,
    plugin_env,
    run_engine,
)
from composer.testing.tiny_model import build_tiny_model, make_prompts  # noqa: E402

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
BASE = make_prompts(3, words=120, seed=21)
TAILS = make_prompts(2, words=40, seed=22)
SHARED = [p + " " + tail for p, tail in zip(BASE[:2], TAILS, strict=True)]
NEW = make_prompts(1, words=120, seed=23)
# Round 1 fills the tier; round 2 repeats, extends and adds prompts.
ROUNDS = [BASE, [BASE[0], SHARED[0], NEW[0], BASE[2], SHARED[1]]]
PLAIN_LLAMA_ROUNDS = ROUNDS


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, plain_llama: SharedRuns
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("offload-cpu")
    model = str(build_tiny_model())
    env = plugin_env(HERE, "offload_cpu_e2e_plugins", kept.MODULE)
    # For load_pipeline here; undone after this module so other tests see only
    # the installed plugins.
    patch = pytest.MonkeyPatch()
    patch.setenv("KV_COMPOSER_PLUGIN_MODULES", f"offload_cpu_e2e_plugins,{kept.MODULE}")
    patch.syspath_prepend(str(HERE))

    def spec(kv: dict[str, Any] | None) -> EngineSpec:
        return EngineSpec(
            model=model,
            rounds=ROUNDS,
            kv_transfer_config=kv,
            env=env,
            max_tokens=8,
            enforce_eager=True,
            in_process=True,
        )

    report = tmp / "corrupt.json"
    out: dict[str, Any] = {"report": report}
    out["plain"] = plain_llama(ROUNDS)
    out["cpu"] = run_engine(spec(tier_pipeline({"capacity": "256MiB"})))
    # A pool far larger than the prompts: its pages are still being mapped when
    # round 1 repeats round 0, right after the engine is ready.
    out["cpu4g"] = run_engine(spec(tier_pipeline({"capacity": "4GiB"})))
    out["corrupt"] = run_engine(
        spec(
            tier_pipeline(
                {"capacity": "256MiB", "checksums": True, "load_mode": "async"},
                {
                    "bad": {
                        "plugin": "offload-cpu-corruptor",
                        "needs": ["cpu"],
                        "config": {"target": "cpu", "report": str(report), "every": 2},
                    },
                    "kept": kept.node(),
                },
                annotate_outputs=True,
            )
        )
    )
    yield out
    patch.undo()


def _cached(result: EngineResult, r: int) -> list[int]:
    return [x.cached_tokens for x in result.rounds[r]]


def test_first_round_computes_everything(runs: dict[str, Any]) -> None:
    assert _cached(runs["cpu"], 0) == [0, 0, 0]


def test_repeats_and_shared_prefixes_are_served_from_the_tier(runs: dict[str, Any]) -> None:
    rnd = runs["cpu"].rounds[1]
    repeat, shared, new, repeat2, shared2 = rnd
    for r in (repeat, repeat2):
        # Every full block but the one holding the last prompt token.
        assert r.cached_tokens == (r.prompt_tokens - 1) // BLOCK * BLOCK > 0
    first = runs["cpu"].rounds[0]
    for r, base in ((shared, first[0]), (shared2, first[1])):
        assert 0 < r.cached_tokens <= base.prompt_tokens // BLOCK * BLOCK
        assert r.cached_tokens % BLOCK == 0
    assert new.cached_tokens == 0


def test_tokens_equal_a_run_without_the_pipeline(runs: dict[str, Any]) -> None:
    plain, cpu = runs["plain"], runs["cpu"]
    assert _cached(plain, 1) == [0, 0, 0, 0, 0]
    for r in range(len(ROUNDS)):
        assert cpu.tokens(r) == plain.tokens(r), f"round {r}"


def test_the_first_requests_are_served_when_repeated_right_after(runs: dict[str, Any]) -> None:
    """capacity 4GiB: saves never wait for the pool's pages to be mapped (that took ~6 s,
    and the repeats missed): round 0 runs right after the engine is ready, round 1 right
    after it, and its repeats of round-0 prompts come from the tier."""
    big, plain = runs["cpu4g"], runs["plain"]
    assert _cached(big, 0) == [0, 0, 0]
    repeat, _, _, repeat2, _ = big.rounds[1]
    for r in (repeat, repeat2):
        assert r.cached_tokens == (r.prompt_tokens - 1) // BLOCK * BLOCK > 0
    for r in range(len(ROUNDS)):
        assert big.tokens(r) == plain.tokens(r), f"round {r}"


def test_corrupt_blocks_are_recomputed_not_served(runs: dict[str, Any]) -> None:
    """Async loads (vLLM's load_async protocol); every other stored block corrupt."""
    report = json.loads(Path(runs["report"]).read_text())
    assert report["corrupted"] > 0
    assert report["load_failures"] > 0 and report["loads_ok"] > 0
    corrupt, plain = runs["corrupt"], runs["plain"]
    for r in range(len(ROUNDS)):
        assert corrupt.tokens(r) == plain.tokens(r), f"round {r}"
    # What the tier is said to have served is what arrived: a refused block and
    # every block after it are recomputed, and not credited.
    wrong, vllm_counts_failed = kept.reported_vs_kept(corrupt.rounds)
    assert not wrong, f"(round, request, reported, kept): {wrong}"
    miscounted = kept.counted_vs_reported(corrupt.rounds, corrupt.metrics)
    assert not miscounted, f"node: (counted on /metrics, reported): {miscounted}"
    assert vllm_counts_failed > 0, "no load lost a block"
    notes = [x.kv_transfer_params["kv_composer"] for rnd in corrupt.rounds for x in rnd]
    assert any(n.get("failed") for n in notes) and any(n["served_by"] for n in notes)
