"""One request from two tiers, inside real vLLM (CPU build, tiny local model).

``examples/tiers-ranges.yaml``: two ``offload-cpu`` nodes, ``fast`` (sync
loads) in front of ``slow`` (async loads), under ``load_policy: ranges``; the
prompts are token ids, so block boundaries are exact (32 tokens). Each round
is one ``generate`` call, and the request's tier controls
(``kv_transfer_params``) put the blocks where the test needs them:

0. ``A`` (100 tokens) is saved by both tiers;
1. ``A+B`` (200) may be saved only by ``slow``: ``fast`` serves ``A``'s 3 blocks;
2. ``A+B+C``: ``fast`` serves ``[0, 96)``, ``slow`` ``[96, 192)``, vLLM computes
   the rest; ``fast`` promotes the 3 blocks ``slow`` loaded;
3. ``A+B+D`` loading only from ``fast`` gets all 6 blocks from it (promoted);
   a request naming an unknown tier loads nothing and says why.

The same rounds run through a second engine whose tiers both refuse every other
block they stored (checksums on, a test node corrupting them): each tier's
ranges fail in some request, and what is said to be served is what arrived.
Tokens equal a plain engine's in both, and in-process engines keep it cheap.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import yaml

from composer import kv_transfer_config, load_pipeline
from composer.testing import kept  # noqa: E402
from composer.testing.engine import EngineResult, EngineSpec, SharedRuns, plugin_env, run_engine
from composer.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
EXAMPLE = HERE.parents[2] / "examples/tiers-ranges.yaml"
BLOCK = 32
_rng = random.Random(20)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(10, 430) for _ in range(n)]  # (the tokenizer has 438)


A, B, C, D = _tokens(100), _tokens(100), _tokens(60), _tokens(60)  # A: 3 full blocks + 4
AB = A[:96] + B[:104]  # 200 tokens: 6 full blocks
ABC, ABD = AB[:192] + C, AB[:192] + D


def _p(tokens: list[int], **params: Any) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if params:
        prompt["kv_transfer_params"] = params
    return prompt


ROUNDS = [
    [_p(A)],
    [_p(AB, kv_store_tiers=["slow"])],
    [_p(ABC)],
    [_p(ABD, kv_load_tiers=["fast"]), _p(ABC, kv_load_tiers=["fsat"])],
]
PLAIN_LLAMA_ROUNDS = [[{"prompt_token_ids": p["prompt_token_ids"]} for p in r] for r in ROUNDS]


def _pipeline(corrupt: Path | None = None) -> dict[str, Any]:
    """``examples/tiers-ranges.yaml``, with the test node that says what vLLM kept;
    ``corrupt``: with checksums, and a node corrupting every other block of each tier."""
    data = yaml.safe_load(EXAMPLE.read_text())
    nodes = data["nodes"]
    nodes["kept"] = kept.node()
    if corrupt:
        for target in ("fast", "slow"):
            nodes[target]["config"]["checksums"] = True
            nodes[f"bad-{target}"] = {
                "plugin": "offload-cpu-corruptor",
                "needs": [target],
                "config": {"target": target, "report": str(corrupt / target), "every": 2},
            }
    return kv_transfer_config(load_pipeline(data))


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, plain_llama: SharedRuns
) -> Iterator[dict[str, EngineResult]]:
    tmp = tmp_path_factory.mktemp("ranges")
    model = str(build_tiny_model())
    patch = pytest.MonkeyPatch()
    patch.setenv("KV_COMPOSER_PLUGIN_MODULES", f"offload_cpu_e2e_plugins,{kept.MODULE}")
    patch.syspath_prepend(str(HERE))
    env = plugin_env(HERE, "offload_cpu_e2e_plugins", kept.MODULE)

    def run(kv: dict[str, Any]) -> EngineResult:
        spec = EngineSpec(
            model=model,
            rounds=ROUNDS,
            kv_transfer_config=kv,
            env=env,
            max_tokens=8,
            enforce_eager=True,
            in_process=True,
        )
        return run_engine(spec)

    try:
        yield {
            "plain": plain_llama(PLAIN_LLAMA_ROUNDS),
            "ranges": run(_pipeline()),
            "corrupt": run(_pipeline(tmp)),
        }
    finally:
        patch.undo()


def _notes(result: EngineResult, r: int) -> list[dict[str, Any]]:
    return [x.kv_transfer_params["kv_composer"] for x in result.rounds[r]]  # type: ignore[index]


@pytest.mark.parametrize("name", ["ranges", "corrupt"])
def test_tokens_equal_a_run_without_the_pipeline(runs: dict[str, EngineResult], name: str) -> None:
    for r in range(len(ROUNDS)):
        assert runs[name].tokens(r) == runs["plain"].tokens(r), f"round {r}"


def test_one_request_loads_its_first_blocks_from_fast_and_the_next_from_slow(
    runs: dict[str, EngineResult],
) -> None:
    result = runs["ranges"]
    assert _notes(result, 0)[0]["tokens"] == 0
    # A+B: only A is anywhere yet (slow also holds it, but fast is asked first).
    assert _notes(result, 1)[0]["ranges"] == [{"node": "fast", "start": 0, "tokens": 96}]
    (abc,) = _notes(result, 2)
    assert abc["ranges"] == [
        {"node": "fast", "start": 0, "tokens": 96},
        {"node": "slow", "start": 96, "tokens": 96},
    ]
    assert abc["served_by"] == "fast+slow" and abc["tokens"] == 192
    assert result.rounds[2][0].cached_tokens == 192  # vLLM's own count agrees
    wrong, failed = kept.reported_vs_kept(result.rounds)
    assert not wrong and failed == 0
    assert not kept.counted_vs_reported(result.rounds, result.metrics)


def test_fast_promoted_what_slow_served_and_load_tiers_are_honoured(
    runs: dict[str, EngineResult],
) -> None:
    abd, unknown = _notes(runs["ranges"], 3)
    # Only fast was asked, and it holds all 6 blocks: A saved, B's 3 promoted.
    assert abd["ranges"] == [{"node": "fast", "start": 0, "tokens": 192}]
    assert unknown["tokens"] == 0 and unknown["ranges"] == []
    assert "kv_load_tiers: unknown node(s) 'fsat'" in unknown["error"]


def test_each_tiers_failed_ranges_are_recomputed_and_not_credited(
    runs: dict[str, EngineResult],
) -> None:
    result = runs["corrupt"]
    wrong, _ = kept.reported_vs_kept(result.rounds)
    assert not wrong, f"(round, request, reported, kept): {wrong}"
    miscounted = kept.counted_vs_reported(result.rounds, result.metrics)
    assert not miscounted, f"node: (counted on /metrics, reported): {miscounted}"
    failed_nodes = {
        f["node"]
        for r in range(len(ROUNDS))
        for note in _notes(result, r)
        for f in (note.get("failed") or [])
    }
    assert failed_nodes == {"fast", "slow"}
