"""Bytes of one KV block (all layers), from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

from composer.simulate import SimulateError

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def bytes_per_block_from_config(path: str | Path, block_size: int) -> int:
    """layers x 2 (K and V) x kv_heads x head_dim x dtype bytes x block tokens, from a
    Hugging Face ``config.json``."""
    file = str(path)
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SimulateError(f"{file}: cannot read model config: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SimulateError(f"{file}: not a JSON model config ({exc})") from None
    if not isinstance(cfg, dict):
        raise SimulateError(f"{file}: expected a JSON object")
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg

    def number(name: str, default: int | None = None) -> int:
        value = cfg.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SimulateError(f"{file}: {name}: expected a positive integer, got {value!r}")
        return value

    layers = number("num_hidden_layers")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    if cfg.get("head_dim") is not None:
        head_dim = number("head_dim")
    else:
        head_dim = number("hidden_size") // heads
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in _DTYPE_BYTES:
        raise SimulateError(f"{file}: torch_dtype: unknown dtype {dtype!r}")
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES[dtype] * block_size
