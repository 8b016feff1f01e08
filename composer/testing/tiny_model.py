"""A tiny Llama with random weights and a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on generated
text, the weights are random with a fixed seed. Built once into a cache folder
and reused (``$KV_COMPOSER_CACHE``, default ``~/.cache/kv-composer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


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
    target = (root or cache_dir()) / f"tiny-llama-{spec.key()}"
    if (target / ".complete").exists():
        return target
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    model.bfloat16()  # in place
    model.save_pretrained(target, safe_serialization=True)
    (target / ".complete").write_text("ok\n")
    return target


def make_prompts(n: int, words: int = 60, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]
