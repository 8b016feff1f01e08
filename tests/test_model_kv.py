"""``kvc validate --model``: KV cache groups predicted from config.json, and what each node
serves of them. No engine runs here: the facts these tests encode were measured on vLLM
CPU 0.32 (tiny Gemma 3: a sliding-window and a full-attention group, 32-token blocks of
8192 bytes; tiny Granite-4 hybrid: a mamba and an attention group, attention blocks of 64)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from composer import discover
from composer.builtin import VLLM
from composer.model.kv_groups import (
    KVGroupSpec,
    ModelConfigError,
    ModelKV,
    ModelUnsupported,
    from_kv_cache_config,
    predict,
)
from composer.testing.tiny_model import (
    GEMMA3_SHAPE,
    GRANITE_HYBRID_SHAPE,
    LLAMA_SWA_SHAPE,
    TinyModelSpec,
    build_tiny_model,
)
from composer.validation import load_pipeline, validate_text
from composer.validation.model_check import check_at_engine_start, check_model

# The tiny models' config.json fields that decide their groups (composer/testing/tiny_model.py).
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "bfloat16",
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "hidden_size": 128, "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64,
}
GRANITE = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "dtype": "bfloat16", "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_size": 128, "layer_types": ["mamba", "attention"],
    "mamba_d_conv": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_expand": 2,
    "mamba_n_groups": 1, "mamba_n_heads": 8,
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 128,
}


def write(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def kinds(model: ModelKV) -> list[tuple[str, int]]:
    return [(g.kind, g.layers) for g in model.groups]


# --------------------------------------------------------------------------- #
# Prediction, family by family
# --------------------------------------------------------------------------- #


def test_gemma3_two_groups_as_measured(tmp_path: Path) -> None:
    model = predict(write(tmp_path, "tiny-gemma3", GEMMA3))
    assert model.groups == (
        KVGroupSpec("sliding_window", 1, 32, 64, 256, page_bytes=8192),
        KVGroupSpec("attention", 1, 32, None, 256, page_bytes=8192),
    )
    assert model.hybrid and model.name == "tiny-gemma3"
    assert model.architecture == "Gemma3ForCausalLM" and model.notes == ()


def test_gemma3_multimodal_nests_text_config(tmp_path: Path) -> None:
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**GEMMA3, "num_hidden_layers": 12, "layer_types": None,
                        "sliding_window_pattern": 6, "sliding_window": 1024},
    }
    model = predict(write(tmp_path, "gemma3-mm", config) / "config.json")
    # 10 sliding + 2 full: group size 2, the sliding layers in 5 groups.
    assert kinds(model) == [("sliding_window", 2)] * 5 + [("attention", 2)]
    assert model.architecture == "Gemma3ForConditionalGeneration"
    assert {g.window for g in model.groups} == {1024, None}


def test_plain_llama_is_one_group(tmp_path: Path) -> None:
    model = predict(write(tmp_path, "llama", LLAMA), block_size=16)
    assert model.groups == (KVGroupSpec("attention", 4, 16, None, 4 * 256, page_bytes=4096),)
    assert not model.hybrid


def test_llama_reads_layer_types(tmp_path: Path) -> None:
    config = {**LLAMA, "num_hidden_layers": 3, "sliding_window": 128,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
    model = predict(write(tmp_path, "llama-swa", config))
    # 2 sliding vs 1 full: group size 1 (2 is not under 1.5 x 1).
    assert kinds(model) == [("sliding_window", 1), ("sliding_window", 1), ("attention", 1)]


def test_mistral_window_on_every_layer_is_one_group(tmp_path: Path) -> None:
    config = {**LLAMA, "model_type": "mistral", "sliding_window": 4096}
    model = predict(write(tmp_path, "mistral", config))
    assert kinds(model) == [("sliding_window", 4)] and not model.hybrid


def test_granite_hybrid_attention_block_grows(tmp_path: Path) -> None:
    model = predict(write(tmp_path, "tiny-granite", GRANITE))
    mamba, attention = model.groups
    # conv (256 + 2*16) * 3 + ssm 8*32*16 values, bf16: 9920 bytes > a 32-token page (8192).
    assert mamba == KVGroupSpec("mamba", 1, None, None, 0, 9920, 16384)
    assert attention == KVGroupSpec("attention", 1, 64, None, 256, page_bytes=16384)


def test_granite_transformers5_layer_names(tmp_path: Path) -> None:
    config = {**GRANITE, "layer_types": ["linear_attention", "full_attention"]}
    assert kinds(predict(write(tmp_path, "g", config))) == [("mamba", 1), ("attention", 1)]


def test_nemotron_h_pattern(tmp_path: Path) -> None:
    config = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M*-M-M*-", "num_hidden_layers": 12, "hidden_size": 256,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "dtype": "bfloat16",
        "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 16,
        "conv_kernel": 4,
    }
    model = predict(write(tmp_path, "nemotron", config))
    # 5 mamba, 2 attention, MLP layers hold nothing: group size 2.
    assert kinds(model) == [("mamba", 2), ("mamba", 2), ("mamba", 1), ("attention", 2)]
    # The SSM state is float32 in vLLM unless the config says otherwise.
    conv, ssm = (256 + 2 * 2 * 16) * 3, 8 * 32 * 16
    assert model.groups[0].state_bytes == 2 * (conv * 2 + ssm * 4)


def test_jamba_attention_period(tmp_path: Path) -> None:
    config = {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "num_hidden_layers": 16,
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "dtype": "bfloat16",
    }
    model = predict(write(tmp_path, "jamba", config))
    assert kinds(model) == [("mamba", 2)] * 7 + [("attention", 2)]
    assert model.groups[0].state_bytes == 2 * (128 * 3 + 128 * 16) * 2


def test_qwen3_next_interval(tmp_path: Path) -> None:
    config = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "num_hidden_layers": 8, "full_attention_interval": 4, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "dtype": "bfloat16",
    }
    model = predict(write(tmp_path, "qwen3-next", config))
    assert kinds(model) == [("mamba", 2)] * 3 + [("attention", 2)]
    assert model.groups[0].state_bytes == 2 * ((16 * 2 * 2 + 16 * 4) * 3 + 4 * 16 * 16) * 2


def test_falcon_h1_has_both_per_layer(tmp_path: Path) -> None:
    config = {
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
        "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_d_head": 32,
        "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "dtype": "bfloat16",
    }
    model = predict(write(tmp_path, "falcon", config))
    assert kinds(model) == [("attention", 3), ("mamba", 3)]


def test_llama4_chunked(tmp_path: Path) -> None:
    config = {**LLAMA, "model_type": "llama4_text", "attention_chunk_size": 8192}
    model = predict(write(tmp_path, "llama4", config))
    # Every 4th layer is NoPE full attention: 3:1, so group size 1.
    assert kinds(model) == [("chunked_local", 1)] * 3 + [("attention", 1)]
    assert model.groups[0].window == 8192


def test_unknown_architecture_is_best_effort(tmp_path: Path) -> None:
    model = predict(write(tmp_path, "odd", {**LLAMA, "model_type": "odd"}))
    assert kinds(model) == [("attention", 4)]
    assert any("not one kvc knows" in note for note in model.notes)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        (GEMMA3_SHAPE, [("sliding_window", 1), ("attention", 1)]),
        (GRANITE_HYBRID_SHAPE, [("mamba", 1), ("attention", 1)]),
        (LLAMA_SWA_SHAPE, [("sliding_window", 1), ("sliding_window", 1), ("attention", 1)]),
    ],
)
def test_local_tiny_models(shape: TinyModelSpec, expected: list[tuple[str, int]]) -> None:
    """The models the engine tests run (their groups there are asserted from vLLM's own)."""
    assert kinds(predict(build_tiny_model(shape))) == expected


# --------------------------------------------------------------------------- #
# Hostile config.json
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON list, not an object"),
        ('{"model_type": "llama"}', "no num_hidden_layers"),
        ('{"num_hidden_layers": "two"}', "num_hidden_layers"),
        ('{"num_hidden_layers": true}', "num_hidden_layers"),
        ('{"num_hidden_layers": 1' + "0" * 30 + "}", "num_hidden_layers"),
        ('{"num_hidden_layers": 1' + "0" * 5000 + "}", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
        ('{"num_hidden_layers": 2, "layer_types": "full"}', "layer_types"),
        (b"\xff\xfe".decode("latin-1"), "not valid JSON"),
    ],
)
def test_hostile_config(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "config.json").write_text(content, encoding="latin-1")
    with pytest.raises(ModelConfigError, match=message):
        predict(tmp_path)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="has no config.json"):
        predict(tmp_path)
    with pytest.raises(ModelConfigError, match="does not exist"):
        predict(tmp_path / "nowhere" / "config.json")
    with pytest.raises(ModelConfigError, match="block size"):
        predict(tmp_path, block_size=0)


# --------------------------------------------------------------------------- #
# What nodes serve
# --------------------------------------------------------------------------- #


def test_every_first_party_type_declares_model_support() -> None:
    types = discover().types
    first_party = ["offload-cpu", "lmcache", "model-tracker", "vllm"]
    assert [t for t in first_party if types[t].model_support is None] == []
    assert VLLM.model_support is not None


LMCACHE_ONLY = """\
version: 1
{hma}nodes:
  lmcache:
    plugin: lmcache
"""


def test_lmcache_refuses_several_groups_and_hma_off_makes_one(tmp_path: Path) -> None:
    gemma = predict(write(tmp_path, "gemma3", GEMMA3))
    pipeline = validate_text(LMCACHE_ONLY.format(hma=""), file="p.yaml")
    check = check_model(pipeline, gemma)
    (problem,) = check.problems
    assert problem.path == ("nodes", "lmcache")
    assert "one KV cache group; model gemma3 has sliding_window+attention groups" in str(problem)

    off = check_model(validate_text(LMCACHE_ONLY.format(hma="hma: off\n"), file="p.yaml"), gemma)
    assert off.problems == () and [g.kind for g in off.runs.groups] == ["attention"]
    assert off.runs.groups[0].layers == 2 and "hma: off" in off.hma_off


def test_mamba_with_hma_off_is_a_pipeline_error(tmp_path: Path) -> None:
    granite = predict(write(tmp_path, "granite", GRANITE))
    text = (
        "version: 1\nhma: off\n"
        "nodes:\n  cpu:\n    plugin: offload-cpu\n    config: {capacity: 1GiB}\n"
    )
    check = check_model(validate_text(text, file="p.yaml"), granite)
    (problem,) = check.problems
    assert problem.path == ("hma",) and "Failed to promote" in problem.message


# --------------------------------------------------------------------------- #
# At engine start, from vLLM's KVCacheConfig (duck-typed fakes)
# --------------------------------------------------------------------------- #


class SlidingWindowSpec(SimpleNamespace):
    pass


class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def runtime_config(*specs: tuple[object, list[str]]) -> SimpleNamespace:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=n) for s, n in specs]
    return SimpleNamespace(kv_cache_groups=groups)


GEMMA_RUNTIME = runtime_config(
    (SlidingWindowSpec(block_size=32, sliding_window=64, page_size_bytes=8192), ["l.0"]),
    (FullAttentionSpec(block_size=32, page_size_bytes=8192), ["l.1"]),
)


def test_from_kv_cache_config_matches_prediction(tmp_path: Path) -> None:
    runtime = from_kv_cache_config(GEMMA_RUNTIME, name="tiny-gemma3")
    assert runtime.groups == predict(write(tmp_path, "tiny-gemma3", GEMMA3)).groups
    granite = from_kv_cache_config(
        runtime_config(
            (MambaSpec(block_size=4096, page_size_bytes=16384, real_page_size_bytes=9920),
             ["l.0"]),
            (FullAttentionSpec(block_size=64, page_size_bytes=16384), ["l.1"]),
        )
    )
    assert granite.groups == predict(write(tmp_path, "tiny-granite", GRANITE)).groups


def test_check_at_engine_start(root: Path) -> None:
    pipeline = load_pipeline(str(root / "examples" / "tracker-offload-lmcache.yaml"))
    with pytest.raises(ValueError, match=r"nodes\.lmcache: .*sliding_window\+attention"):
        check_at_engine_start(pipeline, GEMMA_RUNTIME, model_name="tiny-gemma3")
    one = runtime_config((FullAttentionSpec(block_size=32, page_size_bytes=8192), ["l.0"]))
    check_at_engine_start(pipeline, one)
    offload = load_pipeline(str(root / "examples" / "cpu-offload.yaml"))
    check_at_engine_start(offload, GEMMA_RUNTIME)


def test_without_hma_refuses_mamba(tmp_path: Path) -> None:
    with pytest.raises(ModelUnsupported, match="Failed to promote"):
        predict(write(tmp_path, "granite", GRANITE)).without_hma()


# --------------------------------------------------------------------------- #
# Through the CLI
# --------------------------------------------------------------------------- #


def run(kvc: str, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kvc, *args], capture_output=True, text=True, cwd=root, timeout=120)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {
        "gemma3": write(base, "tiny-gemma3", GEMMA3),
        "granite": write(base, "tiny-granite", GRANITE),
        "llama": write(base, "tiny-llama", LLAMA),
    }


LMCACHE_EXAMPLES = ["examples/tracker-offload-lmcache.yaml", "examples/fleet-valkey.yaml"]
OFFLOAD_EXAMPLES = ["examples/cpu-offload.yaml", "examples/offload-before-nixl.yaml"]


@pytest.mark.parametrize("model", ["gemma3", "granite"])
@pytest.mark.parametrize("example", LMCACHE_EXAMPLES)
def test_cli_refuses_lmcache_on_hybrids(
    kvc: str, root: Path, models: dict[str, Path], model: str, example: str
) -> None:
    proc = run(kvc, root, "validate", example, "--model", str(models[model]))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if "nodes.lmcache" in x]
    assert line.startswith(f"{example}:")
    expected = "sliding_window+attention" if model == "gemma3" else "mamba+attention"
    assert expected in line


@pytest.mark.parametrize("example", OFFLOAD_EXAMPLES)
def test_cli_offload_serves_hybrids(
    kvc: str, root: Path, models: dict[str, Path], example: str
) -> None:
    gemma = run(kvc, root, "validate", example, "--model", str(models["gemma3"]))
    assert gemma.returncode == 0, gemma.stdout + gemma.stderr
    assert "sliding_window  1 layer" in gemma.stdout.replace("sliding_window ", "sliding_window  ")
    assert "cpu" in gemma.stdout and "serves sliding_window" in gemma.stdout
    granite = run(kvc, root, "validate", example, "--model", str(models["granite"]))
    assert granite.returncode == 0, granite.stdout + granite.stderr
    assert "64 tokens/block" in granite.stdout and "serves no hits" in granite.stdout


def test_cli_every_example_on_a_plain_model(kvc: str, root: Path, models: dict[str, Path]) -> None:
    examples = sorted(str(p.relative_to(root)) for p in (root / "examples").glob("*.yaml"))
    proc = run(kvc, root, "validate", *examples, "--model", str(models["llama"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("model", ["gemma3", "granite", "llama"])
def test_cli_every_example_on_every_model(
    kvc: str, root: Path, models: dict[str, Path], model: str
) -> None:
    """Each example x each model: ok or a located refusal, never a traceback."""
    for path in sorted((root / "examples").glob("*.yaml")):
        example = str(path.relative_to(root))
        proc = run(kvc, root, "validate", example, "--model", str(models[model]))
        assert proc.returncode in (0, 2), proc.stdout + proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
        if proc.returncode == 2:
            assert any(x.startswith(f"{example}:") and "nodes." in x
                       for x in proc.stdout.splitlines()), proc.stdout


def test_cli_json(kvc: str, root: Path, models: dict[str, Path]) -> None:
    proc = run(kvc, root, "--json", "validate", *LMCACHE_EXAMPLES[:1], "--model",
               str(models["gemma3"]))
    data = json.loads(proc.stdout)
    assert proc.returncode == 2 and not data["ok"]
    assert [g["kind"] for g in data["model"]["groups"]] == ["sliding_window", "attention"]
    assert data["files"][0]["problems"][0]["path"] == "nodes.lmcache"


@pytest.mark.parametrize("content", [None, "{oops", "[]", '{"num_hidden_layers": -1}'])
def test_cli_bad_model_is_a_clear_error(
    kvc: str, root: Path, tmp_path: Path, content: str | None
) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    proc = run(kvc, root, "validate", "examples/cpu-offload.yaml", "--model", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvc: error: --model: ") and "Traceback" not in proc.stderr


def test_cli_graph_shows_groups_per_node(kvc: str, root: Path, models: dict[str, Path]) -> None:
    proc = run(kvc, root, "graph", "examples/offload-before-nixl.yaml", "--model",
               str(models["gemma3"]))
    assert proc.returncode == 0, proc.stderr
    assert "model: serves sliding_window" in proc.stdout
    assert "model: serves every KV cache group (sliding_window+attention)" in proc.stdout
    refused = run(kvc, root, "graph", LMCACHE_EXAMPLES[0], "--model", str(models["granite"]))
    assert refused.returncode == 2 and "nodes.lmcache" in refused.stderr
