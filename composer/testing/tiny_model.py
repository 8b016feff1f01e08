"""Tiny models with random weights and a locally trained tokenizer.

A Llama by default; hybrid shapes too (``arch``): a Gemma-3-style model whose
layers alternate sliding-window and full attention, a Llama whose
``layer_types`` give some layers a sliding window (vLLM reads them per layer),
and a Granite-4-style mamba2/attention hybrid. Nothing is downloaded: the
tokenizer is a byte-level BPE trained on generated text, the weights are
random with a fixed seed. Built once into a cache folder and reused
(``$KV_COMPOSER_CACHE``, default ``~/.cache/kv-composer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from composer.bench import replay
from composer.trace import read_trace

WORDS = [
    "the",
    "a",
    "cache",
    "block",
    "token",
    "layer",
    "model",
    "vllm",
    "connector",
    "offload",
    "memory",
    "tier",
    "save",
    "load",
    "prefix",
    "request",
    "engine",
    "worker",
    "scheduler",
    "graph",
    "plugin",
    "node",
    "config",
    "pipeline",
    "hash",
    "copy",
    "tensor",
    "page",
    "group",
    "attention",
    "query",
    "key",
    "value",
    "prompt",
    "output",
    "fast",
    "slow",
    "warm",
    "cold",
]


#: Model families the builder knows, by the name tests use.
ARCHS = ("llama", "gemma3", "llama-swa", "granite-hybrid")


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0
    #: Tokens a sliding-window layer sees (gemma3, llama-swa).
    sliding_window: int = 0
    #: Per layer: "sliding_attention" / "full_attention" (gemma3, llama-swa) or
    #: "mamba" / "attention" (granite-hybrid); empty = the family's default pattern.
    layer_types: tuple[str, ...] = ()
    #: Per-head dimension (gemma3); 0 = hidden // heads.
    head_dim: int = 0

    def key(self) -> str:
        fields = asdict(self)
        if not self.head_dim:
            # Added later: specs that leave it unset keep their cache key.
            del fields["head_dim"]
        if self.arch == "llama" and not self.sliding_window and not self.layer_types:
            # The plain Llama's key predates the hybrid fields: keep caches valid.
            for name in ("arch", "sliding_window", "layer_types"):
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


#: Gemma-3-shaped: sliding window 64, layers alternating sliding / full.
GEMMA3_SHAPE = TinyModelSpec(arch="gemma3", layers=2, sliding_window=64, heads=4, kv_heads=2)
#: A Llama whose layer_types give two of three layers a 128-token window.
LLAMA_SWA_SHAPE = TinyModelSpec(
    arch="llama-swa",
    layers=3,
    sliding_window=128,
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
)
#: Granite-4-shaped mamba2 hybrid: mamba, attention.
GRANITE_HYBRID_SHAPE = TinyModelSpec(arch="granite-hybrid", layers=2)


#: Shaped like Gemma-3-1B: 26 layers, 5 sliding-window (512 tokens) : 1 full attention,
#: 4 heads / 1 KV head x 256: 26 KiB of KV per token if every layer kept every token.
GEMMA3_1B_SHAPE = TinyModelSpec(
    arch="gemma3",
    layers=26,
    hidden=1152,
    heads=4,
    kv_heads=1,
    head_dim=256,
    intermediate=6912,
    vocab=2048,
    max_positions=32768,
    sliding_window=512,
    layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26)),
)


#: Shaped like Qwen2-0.5B's attention (24 layers, 2 KV heads x 64): ~12 KiB of KV per token.
QWEN_05B_SHAPE = TinyModelSpec(
    layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=2048, seed=0
)


def cache_dir() -> Path:
    root = os.environ.get("KV_COMPOSER_CACHE") or Path.home() / ".cache" / "kv-composer"
    return Path(root)


def corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec(), root: Path | None = None) -> Path:
    """Path of a local HF model folder for ``spec``, building it on first use."""
    if spec.arch not in ARCHS:
        raise ValueError(f"unknown arch {spec.arch!r}; known: {', '.join(ARCHS)}")
    target = (root or cache_dir()) / f"tiny-{spec.arch}-{spec.key()}"
    if (target / ".complete").exists():
        return target
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed=spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(target)

    torch.manual_seed(spec.seed)
    model = _model(spec, len(fast), fast.bos_token_id, fast.eos_token_id)
    model.bfloat16()  # in place
    model.save_pretrained(target, safe_serialization=True)
    (target / ".complete").write_text("ok\n")
    return target


def _model(spec: TinyModelSpec, vocab: int, bos: int, eos: int) -> Any:
    """The random-weight transformers model of ``spec``."""
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        dtype="bfloat16",
    )
    if spec.arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        kinds = spec.layer_types or tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)
        )
        head_dim = spec.head_dim or spec.hidden // spec.heads
        gemma = Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=spec.sliding_window or 64,
            layer_types=list(kinds),
            pad_token_id=0,
        )
        return Gemma3ForCausalLM(gemma)
    if spec.arch == "granite-hybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        kinds = spec.layer_types or tuple(
            "mamba" if i % 2 == 0 else "attention" for i in range(spec.layers)
        )
        granite = GraniteMoeHybridConfig(
            **common,
            layer_types=list(kinds),
            num_local_experts=0,
            shared_intermediate_size=spec.intermediate,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_chunk_size=64,
            position_embedding_type="rope",
        )
        return GraniteMoeHybridForCausalLM(granite)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(**common)
    if spec.arch == "llama-swa":
        # transformers' Llama ignores these; vLLM's Llama reads them per layer.
        llama.layer_types = list(spec.layer_types)
        llama.sliding_window = spec.sliding_window
    return LlamaForCausalLM(llama)


def make_prompts(n: int, words: int = 60, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


#: The repository's slice of Mooncake's conversation trace (``tests/data/traces``).
TRACE_SLICE = (
    Path(__file__).parents[2]
    / "tests"
    / "data"
    / "traces"
    / "mooncake-conversation_trace-500.jsonl"
)


def trace_prompts(n: int, model: str, max_model_len: int = 1024) -> list[dict[str, list[int]]]:
    """The first ``n`` requests of :data:`TRACE_SLICE` that fit ``max_model_len``, as
    token-id prompts in ``model``'s vocabulary (a trace block of 512 tokens scaled
    to 32, one vLLM block of the tests)."""

    prompts, _ = replay.make_prompts(
        read_trace(TRACE_SLICE, limit=3 * n),
        scale=16,
        vocab_size=replay.vocab_size_of(model) or 0,
        max_model_len=max_model_len,
    )
    return [{"prompt_token_ids": p.token_ids} for p in prompts[:n]]
