"""offload-cpu on hybrid models inside real vLLM (CPU build, tiny local models).

vLLM's hybrid KV cache manager stays on with the pipeline: one KV cache group
per kind of layer. Models: a Gemma-3-shaped model (sliding window 64, layers
alternating sliding/full), a Llama whose ``layer_types`` give two of three
layers a 128-token window, and a Granite-4-shaped mamba2/attention hybrid.

Engines (one at a time, all with the same VLLM_CPU_OMP_THREADS_BIND):

* gemma3 without a connector (the reference), with offload-cpu (sync loads),
  and with async loads and checksums while a test node corrupts every other
  stored block (every failed load must become a recompute, per request: vLLM
  takes no failed block ids with several groups);
* the per-layer-window Llama with offload-cpu and vLLM's own prefix cache on;
  its repeats must give the tokens its first round computed;
* the mamba hybrid with offload-cpu: the engine starts, the node says once that
  it serves no hits for this model, tokens are the ones its first round computed.

Prompts: shorter than the window and over 4x longer, exact repeats, a shared
prefix with a new tail, several requests in flight.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from offload_cpu_e2e_plugins import tier_pipeline

from composer import kv_transfer_config, load_pipeline
from composer.testing.engine import (
    EngineFailed,
    EngineResult,
    EngineSpec,
    plugin_env,
    run_engine,
)
from composer.testing.tiny_model import (
    GEMMA3_SHAPE,
    GRANITE_HYBRID_SHAPE,
    LLAMA_SWA_SHAPE,
    build_tiny_model,
    make_prompts,
)

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 32
#: Two prompts of ~120 tokens (about 2x the gemma3 window), one of ~700 (10x),
#: one shorter than the window.
BASE = make_prompts(2, words=120, seed=21) + make_prompts(1, words=700, seed=24)
SHORT = make_prompts(1, words=20, seed=25)[0]
SHARED = BASE[0] + " " + make_prompts(1, words=40, seed=22)[0]
# Round 0 fills the tier; round 1 repeats, extends and adds prompts, all in flight together.
ROUNDS = [[*BASE, SHORT], [BASE[0], SHARED, BASE[2], SHORT, BASE[1]]]
#: Round 1 index -> the round 0 index of the same prompt.
REPEATS = {0: 0, 2: 2, 3: 3, 4: 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("offload-cpu-hybrid")
    env = plugin_env(HERE, "offload_cpu_e2e_plugins")
    patch = pytest.MonkeyPatch()
    patch.setenv("KV_COMPOSER_PLUGIN_MODULES", "offload_cpu_e2e_plugins")
    patch.syspath_prepend(str(HERE))
    gemma, swa, granite = (
        str(build_tiny_model(s)) for s in (GEMMA3_SHAPE, LLAMA_SWA_SHAPE, GRANITE_HYBRID_SHAPE)
    )

    def run(model: str, kv: dict[str, Any] | None, **kw: Any) -> EngineResult:
        return run_engine(
            EngineSpec(
                model=model,
                rounds=ROUNDS,
                kv_transfer_config=kv,
                env=env,
                enforce_eager=True,
                in_process=True,
                **kw,
            )
        )

    report = tmp / "corrupt.json"
    out: dict[str, Any] = {"report": report}
    out["plain"] = run(gemma, None)
    out["cpu"] = run(gemma, tier_pipeline({"capacity": "256MiB"}))
    out["corrupt"] = run(
        gemma,
        tier_pipeline(
            {"capacity": "256MiB", "checksums": True, "load_mode": "async"},
            {
                "bad": {
                    "plugin": "offload-cpu-corruptor",
                    "needs": ["cpu"],
                    "config": {"target": "cpu", "report": str(report), "every": 2},
                }
            },
        ),
    )
    out["swa"] = run(swa, tier_pipeline({"capacity": "256MiB"}), prefix_caching=True)
    out["granite"] = run(granite, tier_pipeline({"capacity": "256MiB"}))
    yield out
    patch.undo()


def _groups(result: EngineResult) -> list[str]:
    """The kinds of the KV cache groups vLLM handed the node (its KVCacheConfig)."""
    found = re.search(r"offload-cpu scheduler .*groups=([\w,]+)", result.log)
    assert found, "the node did not log the KV cache groups it was given"
    return found.group(1).split(",")


def _capacity(result: EngineResult) -> int:
    found = re.search(r"KV cache size: ([\d,]+) tokens", result.log)
    assert found, "vLLM did not log its KV cache size"
    return int(found.group(1).replace(",", ""))


def _cached(result: EngineResult, r: int) -> list[int]:
    return [x.cached_tokens for x in result.rounds[r]]


def test_vllm_keeps_its_hybrid_manager_with_the_pipeline(runs: dict[str, Any]) -> None:
    expected = {
        "cpu": ["sliding_window", "attention"],
        "corrupt": ["sliding_window", "attention"],
        # Two window layers, one full: vLLM makes one group per layer here.
        "swa": ["sliding_window", "sliding_window", "attention"],
        "granite": ["mamba", "attention"],
    }
    for name, kinds in expected.items():
        assert _groups(runs[name]) == kinds, name
        assert "Turning off hybrid kv cache manager" not in runs[name].log, name
    # The window layers' memory is not given up: the same KV capacity in tokens.
    assert _capacity(runs["cpu"]) == _capacity(runs["plain"])


def test_tokens_equal_a_run_without_the_pipeline(runs: dict[str, Any]) -> None:
    plain = runs["plain"]
    assert _cached(plain, 1) == [0] * 5
    for name in ("cpu", "corrupt"):
        for r in range(len(ROUNDS)):
            assert runs[name].tokens(r) == plain.tokens(r), f"{name} round {r}"


def test_repeats_and_shared_prefixes_are_served_from_the_tier(runs: dict[str, Any]) -> None:
    first, rnd = runs["cpu"].rounds
    assert _cached(runs["cpu"], 0) == [0, 0, 0, 0]
    repeat, shared, long, short, repeat2 = rnd
    for r in (repeat, long, repeat2):
        # Every full block but the one holding the last prompt token.
        assert r.cached_tokens == (r.prompt_tokens - 1) // BLOCK * BLOCK > 0
    # The end of the first prompt is a retained hit point for the window layers.
    assert shared.cached_tokens == first[0].prompt_tokens // BLOCK * BLOCK
    assert short.cached_tokens == 0  # shorter than one block past the first


def test_corrupt_blocks_are_recomputed_not_served(runs: dict[str, Any]) -> None:
    report = json.loads(Path(runs["report"]).read_text())
    assert report["corrupted"] > 0
    assert report["load_failures"] > 0 and report["loads_ok"] > 0
    assert "Recovered from KV load failure" in runs["corrupt"].log or (
        "failed_recving" not in runs["corrupt"].log
    )


def test_per_layer_windows_with_vllms_prefix_cache(runs: dict[str, Any]) -> None:
    swa = runs["swa"]
    for r1, r0 in REPEATS.items():
        assert swa.rounds[1][r1].tokens == swa.rounds[0][r0].tokens, f"prompt {r1}"
    long = swa.rounds[1][2]
    assert long.cached_tokens == (long.prompt_tokens - 1) // BLOCK * BLOCK


def test_a_state_space_hybrid_runs_and_the_node_says_it_serves_nothing(
    runs: dict[str, Any],
) -> None:
    granite = runs["granite"]
    for r1, r0 in REPEATS.items():
        assert granite.rounds[1][r1].tokens == granite.rounds[0][r0].tokens, f"prompt {r1}"
    assert _cached(granite, 1) == [0] * 5
    said = [line for line in granite.log.splitlines() if "offload-cpu disabled" in line]
    assert len(said) == 1, said  # once, in the scheduler
    assert "mamba" in said[0] and "serves no hits" in said[0] and "tiny-granite" in said[0]


def test_a_node_that_cannot_serve_the_groups_stops_the_engine_with_the_validate_message() -> None:
    """LMCache's connector dies in register_kv_caches with several groups ("engine-driven
    transfer does not support multiple KV transfer groups now"); the composed connector
    stops the engine before that, with what `kvc validate --model` says."""
    lmcache = {"plugin": "lmcache", "config": {"mode": "server", "chunk_size": BLOCK}}
    kv = kv_transfer_config(load_pipeline({"version": 1, "nodes": {"lm": lmcache}}))
    model = str(build_tiny_model(GEMMA3_SHAPE))
    env = plugin_env(HERE, "offload_cpu_e2e_plugins")  # as the other engines of this module
    with pytest.raises(EngineFailed) as failed:
        run_engine(
            EngineSpec(
                model=model,
                rounds=[[SHORT]],
                kv_transfer_config=kv,
                env=env,
                enforce_eager=True,
                in_process=True,
            )
        )
    log = failed.value.log
    assert "nodes.lm: LMCache 0.5.6's connector handles one KV cache group" in log
    assert "sliding_window+attention" in log and "hma: off" in log
    assert "multiple KV transfer groups" not in log
