"""A model's KV cache groups, predicted from its ``config.json`` the way vLLM 0.32 forms them.

vLLM's hybrid KV cache manager gives each kind of layer its own block table (a
*KV cache group*): full attention, sliding window, chunked local attention,
mamba / linear-attention state. A connector node that handles only some of
them cannot serve such a model, and vLLM says so only once the engine is half
up. :func:`predict` answers before launch, from ``config.json`` alone (no
weights, no torch, no vLLM, no transformers); :func:`from_kv_cache_config`
gives the same description from vLLM's runtime ``KVCacheConfig``.

What is reproduced from vLLM 0.32 (read from its source):

* which layers are which kind: the model family's config fields, as
  transformers' configuration classes default them and vLLM's model classes
  read them (``layer_types``, ``sliding_window``, ``hybrid_override_pattern``,
  ``attn_layer_period``, ...);
* the grouping when every layer's page has the same size
  (``kv_cache_utils._get_kv_cache_groups_uniform_page_size``): layers of one
  kind form ``ceil(n / group_size)`` groups, ``group_size`` the smallest
  kind's layer count (the largest when no kind has 1.5x the smallest's),
  the i-th group taking every ``num_groups``-th layer;
* mamba hybrids (``Platform._align_hybrid_block_size``): the attention block
  grows to the smallest multiple of the kernel block whose page holds one
  layer's mamba state, and the mamba page is padded to the attention page.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

GroupKind = Literal["attention", "sliding_window", "chunked_local", "mamba"]

#: vLLM CPU's attention backend runs blocks of a multiple of 32 tokens
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes``); the mamba
#: alignment rounds the attention block up to it.
KERNEL_BLOCK = 32
#: A config.json is a few kilobytes; anything this large is not one.
MAX_CONFIG_BYTES = 8 * 1024 * 1024

_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "fp16": 2, "bf16": 2,
    "float32": 4, "float": 4, "fp32": 4,
}


class ModelConfigError(ValueError):
    """The model path or its ``config.json`` cannot be read as a model description."""


class ModelUnsupported(Exception):  # noqa: N818 - reads as the sentence it carries
    """A node cannot serve this model: the message says why and what to change."""


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group, as vLLM allocates it."""

    kind: GroupKind
    #: Layers in the group (vLLM pads a short last group of a kind; padding is not counted).
    layers: int
    #: Tokens per block; None for mamba (one state per request, whatever its length).
    block_size: int | None
    #: Tokens: the sliding window or the attention chunk; None for full attention and mamba.
    window: int | None
    #: K+V bytes per token over the group's layers (0 for mamba).
    bytes_per_token: int
    #: Mamba: bytes of one request's state over the group's layers (0 for attention).
    state_bytes: int = 0
    #: Bytes of one block of one layer as allocated (mamba pages padded to the attention page).
    page_bytes: int = 0


@dataclass(frozen=True)
class ModelKV:
    """A model's KV cache groups, in vLLM's group order."""

    name: str
    architecture: str
    groups: tuple[KVGroupSpec, ...]
    #: What the prediction had to guess (unknown architecture, missing dtype, ...).
    notes: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[GroupKind, ...]:
        """Each group kind once, in group order."""
        return tuple(dict.fromkeys(g.kind for g in self.groups))

    @property
    def hybrid(self) -> bool:
        return len(self.kinds) > 1

    @property
    def label(self) -> str:
        """How messages name the model: ``model tiny-gemma3`` (``the model`` when unnamed)."""
        return f"model {self.name}" if self.name else "the model"

    @property
    def kinds_label(self) -> str:
        """``sliding_window+attention``: how messages name the model's groups."""
        return "+".join(self.kinds) or "no"

    def without_hma(self) -> ModelKV:
        """The groups vLLM forms with its hybrid manager off (``unify_hybrid_kv_cache_specs``).

        Sliding-window and chunked layers become full-attention layers of one
        group (their compute stays windowed; their blocks are kept whole).
        Raises :class:`ModelUnsupported` where vLLM cannot do that (a mamba
        group next to another kind: "Failed to promote local KV cache specs
        to one unified type").
        """
        if len(self.groups) <= 1 or not self.hybrid:
            return self
        if "mamba" in self.kinds or "attention" not in self.kinds:
            raise ModelUnsupported(
                f"{self.label} has {self.kinds_label} KV cache groups, which need vLLM's "
                "hybrid KV cache manager: with it off vLLM cannot start (\"Failed to promote "
                'local KV cache specs to one unified type")'
            )
        full = next(g for g in self.groups if g.kind == "attention")
        merged = KVGroupSpec(
            kind="attention",
            layers=sum(g.layers for g in self.groups),
            block_size=full.block_size,
            window=None,
            bytes_per_token=sum(g.bytes_per_token for g in self.groups),
            page_bytes=full.page_bytes,
        )
        return replace(self, groups=(merged,))


# --------------------------------------------------------------------------- #
# config.json, as far as the prediction reads it
# --------------------------------------------------------------------------- #

#: Bounded so that a hostile file cannot make the arithmetic below absurd.
_Count = Annotated[int, Field(strict=True, ge=1, le=1_000_000)]
_Offset = Annotated[int, Field(strict=True, ge=0, le=1_000_000)]
_Tokens = Annotated[int, Field(strict=True, ge=0, le=1 << 40)]
_Names = Annotated[list[str], Field(max_length=1_000_000)]


class _TextConfig(BaseModel):
    """The fields of a Hugging Face ``config.json`` that decide the KV cache groups."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model_type: str = ""
    architectures: list[str] | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    num_hidden_layers: _Count | None = None
    num_attention_heads: _Count | None = None
    num_key_value_heads: _Count | None = None
    head_dim: _Count | None = None
    hidden_size: _Count | None = None
    layer_types: _Names | None = None
    sliding_window: _Tokens | None = None
    use_sliding_window: bool | None = None
    sliding_window_pattern: _Count | None = None
    sliding_window_pattern_private: _Count | None = Field(None, alias="_sliding_window_pattern")
    attention_chunk_size: _Tokens | None = None
    no_rope_layers: Annotated[list[int], Field(max_length=1_000_000)] | None = None
    no_rope_layer_interval: _Count = 4
    # Nemotron-H
    hybrid_override_pattern: Annotated[str, Field(max_length=1_000_000)] | None = None
    layers_block_type: _Names | None = None
    mamba_num_heads: _Count | None = None
    mamba_head_dim: _Count | None = None
    n_groups: _Count | None = None
    ssm_state_size: _Count | None = None
    conv_kernel: _Count | None = None
    mamba_ssm_cache_dtype: str | None = None
    # Jamba
    attn_layer_period: _Count | None = None
    attn_layer_offset: _Offset | None = None
    # Qwen3-Next
    full_attention_interval: _Count | None = None
    linear_num_key_heads: _Count | None = None
    linear_num_value_heads: _Count | None = None
    linear_key_head_dim: _Count | None = None
    linear_value_head_dim: _Count | None = None
    linear_conv_kernel_dim: _Count | None = None
    # Granite-4 hybrid, Falcon-H1, Jamba
    mamba_n_heads: _Count | None = None
    mamba_n_groups: _Count | None = None
    mamba_d_state: _Count | None = None
    mamba_d_head: _Count | Literal["auto"] | None = None
    mamba_d_conv: _Count | None = None
    mamba_expand: _Count | None = None
    mamba_d_ssm: _Count | None = None


def _read_config(model: str | Path) -> tuple[str, dict[str, Any]]:
    """(model name, the parsed config.json) of a model directory or a config.json path."""
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    name = (path if path.is_dir() else path.parent).name or str(path)
    try:
        with file.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        where = f"{path} has no config.json" if path.is_dir() else f"{file} does not exist"
        raise ModelConfigError(
            f"{where} (give a local model directory or its config.json)"
        ) from None
    except OSError as exc:
        raise ModelConfigError(f"cannot read {file}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelConfigError(
            f"{file} is larger than {MAX_CONFIG_BYTES:,} bytes: not a config.json"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and integers past Python's digit limit.
        raise ModelConfigError(f"{file} is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return name, data


def _parse(file_label: str, data: dict[str, Any]) -> tuple[_TextConfig, str]:
    """The text model's config (Gemma 3's multimodal configs nest it) and the architecture."""
    text = data.get("text_config")
    merged = {**data, **text} if isinstance(text, dict) else data
    try:
        config = _TextConfig.model_validate(merged)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
            for e in exc.errors()[:5]
        )
        raise ModelConfigError(f"{file_label}: {errors}") from None
    outer = data.get("architectures")
    archs = outer if isinstance(outer, list) and outer else config.architectures or []
    architecture = str(archs[0]) if archs else config.model_type or "unknown"
    return config, architecture


# --------------------------------------------------------------------------- #
# Layers
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Layer:
    kind: GroupKind
    window: int | None = None


_LAYER_TYPE_KINDS: dict[str, GroupKind] = {
    "full_attention": "attention",
    "attention": "attention",
    "sliding_attention": "sliding_window",
    "chunked_attention": "chunked_local",
    "mamba": "mamba",
    "linear_attention": "mamba",
}
#: Layer types that hold no KV cache (Nemotron-H's MLP and MoE blocks).
_NO_CACHE = frozenset({"mlp", "moe", "-", "E"})
_PATTERN_KINDS: dict[str, str] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}

_KNOWN = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "granite",
    "granitemoehybrid", "nemotron_h", "jamba", "qwen3_next", "falcon_h1", "llama4",
    "llama4_text", "gpt_oss", "cohere2", "phi3", "mixtral",
})


def _layers(c: _TextConfig, notes: list[str]) -> list[_Layer]:
    """Each layer's KV cache kind, in layer order (Falcon-H1: two entries per layer)."""
    sliding = c.sliding_window or None  # vLLM reads 0 as "no sliding window"
    if c.use_sliding_window is False:
        sliding = None  # Qwen2/Qwen3: transformers drops the window then
    types = _layer_types(c, notes)

    if c.model_type == "falcon_h1":
        # Every Falcon-H1 layer runs attention and a mamba mixer side by side.
        n = _need(c.num_hidden_layers, "num_hidden_layers")
        return [_Layer("attention"), _Layer("mamba")] * n
    if types is None:
        n = _need(c.num_hidden_layers, "num_hidden_layers")
        # vLLM sets a model-level window only where layer_types does not choose per layer.
        kind: GroupKind = "sliding_window" if sliding else "attention"
        return [_Layer(kind, sliding if sliding else None)] * n
    layers: list[_Layer] = []
    for t in types:
        if t in _NO_CACHE:
            continue
        kind = _LAYER_TYPE_KINDS.get(t, "attention")
        if t not in _LAYER_TYPE_KINDS:
            notes.append(f'layer type "{t[:40]}" is not known: counted as full attention')
        if kind == "sliding_window" and not sliding:
            kind = "attention"  # no window configured: vLLM runs it as full attention
        window = sliding if kind == "sliding_window" else None
        if kind == "chunked_local":
            window = c.attention_chunk_size or None
            if window is None:
                kind = "attention"
        layers.append(_Layer(kind, window))
    return layers


def _layer_types(c: _TextConfig, notes: list[str]) -> list[str] | None:
    """The per-layer types, given or as transformers derives them; None: all layers alike."""
    n = c.num_hidden_layers
    if c.model_type == "nemotron_h":
        if c.hybrid_override_pattern is not None:
            unknown = sorted(set(c.hybrid_override_pattern) - set(_PATTERN_KINDS))
            if unknown:
                raise ModelConfigError(
                    f"hybrid_override_pattern has {unknown[:5]}: expected M, *, - or E"
                )
            return [_PATTERN_KINDS[ch] for ch in c.hybrid_override_pattern]
        return c.layers_block_type or c.layer_types
    if c.layer_types is not None:
        if n is not None and len(c.layer_types) != n:
            notes.append(
                f"layer_types has {len(c.layer_types)} entries for {n} layers: "
                "layer_types is used"
            )
        return c.layer_types
    if c.model_type == "jamba":
        count = _need(n, "num_hidden_layers")
        period, offset = c.attn_layer_period or 8, c.attn_layer_offset
        offset = 4 if offset is None else offset
        return ["attention" if i % period == offset else "mamba" for i in range(count)]
    if c.model_type == "qwen3_next":
        count, every = _need(n, "num_hidden_layers"), c.full_attention_interval or 4
        return [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(count)
        ]
    if c.model_type == "granitemoehybrid":
        return ["mamba"] * _need(n, "num_hidden_layers")  # transformers' default
    if c.model_type in ("gemma2", "gemma3", "gemma3_text"):
        count = _need(n, "num_hidden_layers")
        every = (
            c.sliding_window_pattern
            or c.sliding_window_pattern_private
            or (2 if c.model_type == "gemma2" else 6)  # transformers' defaults
        )
        return [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(count)
        ]
    if c.model_type in ("llama4", "llama4_text") and c.attention_chunk_size:
        count = _need(n, "num_hidden_layers")
        rope = c.no_rope_layers or [
            int((i + 1) % c.no_rope_layer_interval != 0) for i in range(count)
        ]
        return ["chunked_attention" if r else "full_attention" for r in rope[:count]]
    return None


def _need(value: int | None, field: str) -> int:
    if value is None:
        raise ModelConfigError(f"config.json has no {field}")
    return value


# --------------------------------------------------------------------------- #
# Sizes
# --------------------------------------------------------------------------- #


def _dtype_bytes(name: str | None, notes: list[str], default: int = 2) -> int:
    if name is None:
        return default
    size = _DTYPE_BYTES.get(name.lower().removeprefix("torch."))
    if size is None:
        notes.append(f'dtype "{name[:40]}" is not known: {default} bytes per value assumed')
        return default
    return size


def _attention_token_bytes(c: _TextConfig, dtype: int) -> int:
    """K+V bytes of one token in one attention layer."""
    heads = _need(c.num_attention_heads, "num_attention_heads")
    kv_heads = c.num_key_value_heads or heads
    head_dim = c.head_dim or _need(c.hidden_size, "hidden_size") // heads
    return 2 * kv_heads * head_dim * dtype


def _mamba2(
    intermediate: int, groups: int, heads: int, head_dim: int, state: int, conv: int
) -> tuple[int, int]:
    """Values in (conv state, temporal state), as vLLM's ``mamba2_state_shape``."""
    return (intermediate + 2 * groups * state) * (conv - 1), heads * head_dim * state


def _mamba_state_bytes(c: _TextConfig, dtype: int, notes: list[str]) -> int:
    """Bytes of one request's state in one mamba layer, as the family's vLLM class sizes it."""
    mt = c.model_type
    ssm_dtype = dtype
    if mt == "nemotron_h":
        heads = c.mamba_num_heads or 128
        head_dim = c.mamba_head_dim or 64
        conv, temporal = _mamba2(
            heads * head_dim, c.n_groups or 8, heads, head_dim,
            c.ssm_state_size or 128, c.conv_kernel or 4,
        )
        # vLLM keeps Nemotron-H's SSM state in float32 unless the config says otherwise.
        ssm_dtype = _dtype_bytes(c.mamba_ssm_cache_dtype or "float32", notes)
    elif mt == "qwen3_next":
        k_heads, v_heads = c.linear_num_key_heads or 16, c.linear_num_value_heads or 32
        k_dim, v_dim = c.linear_key_head_dim or 128, c.linear_value_head_dim or 128
        conv = (k_dim * k_heads * 2 + v_dim * v_heads) * ((c.linear_conv_kernel_dim or 4) - 1)
        temporal = v_heads * v_dim * k_dim
    elif mt == "jamba":
        inner = (c.mamba_expand or 2) * _need(c.hidden_size, "hidden_size")
        conv, temporal = inner * ((c.mamba_d_conv or 4) - 1), inner * (c.mamba_d_state or 16)
    else:
        if mt not in ("granitemoehybrid", "falcon_h1"):
            notes.append(f"mamba state of {mt or 'this model'} sized as a Mamba-2 layer")
        hidden = _need(c.hidden_size, "hidden_size")
        inner = (c.mamba_expand or 2) * hidden
        if mt == "falcon_h1" and "mamba_d_ssm" not in c.model_fields_set:
            inner = 1024  # transformers' FalconH1Config default
        elif c.mamba_d_ssm is not None:
            inner = c.mamba_d_ssm
        heads = c.mamba_n_heads or 128
        head_dim = c.mamba_d_head if isinstance(c.mamba_d_head, int) else max(inner // heads, 1)
        conv, temporal = _mamba2(
            inner, c.mamba_n_groups or 1, heads, head_dim,
            c.mamba_d_state or 256, c.mamba_d_conv or 4,
        )
    return conv * dtype + temporal * ssm_dtype


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _groups(
    layers: Sequence[_Layer], token_bytes: int, state_bytes: int, block_size: int
) -> tuple[KVGroupSpec, ...]:
    """vLLM's grouping of ``layers`` (see the module docstring)."""
    if any(layer.kind == "mamba" for layer in layers) and any(
        layer.kind != "mamba" for layer in layers
    ):
        # Platform._align_hybrid_block_size: the attention page must hold one mamba state.
        align = max(KERNEL_BLOCK, block_size)
        needed = align * _cdiv(state_bytes, align * token_bytes)
        needed = KERNEL_BLOCK * _cdiv(needed, KERNEL_BLOCK)
        block_size = max(block_size, needed)
    page = block_size * token_bytes

    buckets: dict[tuple[GroupKind, int | None], int] = {}
    for layer in layers:
        key = (layer.kind, layer.window)
        buckets[key] = buckets.get(key, 0) + 1
    smallest, largest = min(buckets.values()), max(buckets.values())
    # One kind: one group. Several: the "1" of an n:1 pattern, unless the kinds are
    # nearly even (then the largest, padding the others).
    group_size = largest if largest < smallest * 1.5 else smallest

    out: list[KVGroupSpec] = []
    for (kind, window), count in buckets.items():
        n_groups = _cdiv(count, group_size)
        for i in range(n_groups):
            members = len(range(i, count, n_groups))  # layers[i::n_groups]
            if kind == "mamba":
                out.append(
                    KVGroupSpec(kind, members, None, None, 0, members * state_bytes,
                                page if token_bytes else state_bytes)
                )
            else:
                out.append(
                    KVGroupSpec(kind, members, block_size, window, members * token_bytes,
                                page_bytes=page)
                )
    return tuple(out)


def predict(model: str | Path, *, block_size: int = 32) -> ModelKV:
    """The KV cache groups vLLM 0.32 (CPU build) forms for ``model`` with its hybrid
    manager on: a local model directory or the path of its ``config.json``.

    Raises :class:`ModelConfigError` when the path or the file cannot be used.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ModelConfigError(f"block size must be a positive integer, not {block_size!r}")
    name, data = _read_config(model)
    config, architecture = _parse(f"{name}/config.json", data)
    notes: list[str] = []
    if config.model_type not in _KNOWN:
        notes.append(
            f'model type "{config.model_type[:40]}" is not one kvc knows: predicted from '
            "num_hidden_layers, layer_types and sliding_window"
        )
    if config.dtype is None and config.torch_dtype is None:
        notes.append("config.json names no dtype: 2 bytes per value assumed")
    dtype = _dtype_bytes(config.dtype or config.torch_dtype, notes)
    layers = _layers(config, notes)
    if not layers:
        return ModelKV(name, architecture, (), tuple(notes))
    has_attention = any(layer.kind != "mamba" for layer in layers)
    has_mamba = any(layer.kind == "mamba" for layer in layers)
    token_bytes = _attention_token_bytes(config, dtype) if has_attention else 0
    state_bytes = _mamba_state_bytes(config, dtype, notes) if has_mamba else 0
    groups = _groups(layers, token_bytes, state_bytes, block_size)
    return ModelKV(name, architecture, groups, tuple(dict.fromkeys(notes)))


# --------------------------------------------------------------------------- #
# From vLLM's runtime KVCacheConfig (duck-typed: this module never imports vLLM)
# --------------------------------------------------------------------------- #


def _spec_kind(spec: object) -> GroupKind:
    name = type(spec).__name__
    if name.endswith("SlidingWindowSpec") or name.endswith("SlidingWindowMLASpec"):
        return "sliding_window"
    if name.endswith("ChunkedLocalAttentionSpec"):
        return "chunked_local"
    if "Mamba" in name or ("State" in name and "HiddenState" not in name):
        return "mamba"
    return "attention"


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def from_kv_cache_config(
    kv_cache_config: object, *, name: str = "", architecture: str = ""
) -> ModelKV:
    """The groups of a running engine, from vLLM's ``KVCacheConfig``."""
    groups: list[KVGroupSpec] = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = getattr(group, "kv_cache_spec", None)
        # UniformTypeKVCacheSpecs wraps per-layer specs of one kind.
        inner = getattr(spec, "kv_cache_specs", None)
        first = next(iter(inner.values()), spec) if isinstance(inner, dict) else spec
        kind = _spec_kind(first)
        layers = len(getattr(group, "layer_names", None) or ())
        page = _int(getattr(first, "page_size_bytes", 0))
        real = _int(getattr(first, "real_page_size_bytes", page)) or page
        if kind == "mamba":
            groups.append(KVGroupSpec(kind, layers, None, None, 0, layers * real, page))
            continue
        block = _int(getattr(first, "block_size", 0)) or None
        window = getattr(first, "sliding_window", None) if kind == "sliding_window" else None
        if kind == "chunked_local":
            window = getattr(first, "attention_chunk_size", None)
        per_token = real // block if block else 0
        groups.append(
            KVGroupSpec(kind, layers, block, _int(window) or None, layers * per_token,
                        page_bytes=page)
        )
    return ModelKV(name, architecture, tuple(groups))


def group_rows(groups: Iterable[KVGroupSpec]) -> list[str]:
    """One aligned line per group: kind, layers, tokens per block, window, bytes."""
    rows = []
    for i, g in enumerate(groups):
        layers = f"{g.layers} layer{'s' * (g.layers != 1)}"
        block = f"{g.block_size} tokens/block" if g.block_size else "state per request"
        window = f"window {g.window}" if g.window else "-"
        size = (
            f"{_bytes(g.state_bytes)} state/request" if g.kind == "mamba"
            else f"{_bytes(g.bytes_per_token)}/token"
        )
        rows.append(f"group {i}  {g.kind:<14} {layers:<10} {block:<18} {window:<12} {size}")
    return rows


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.4g} KiB"
    return f"{n / (1024 * 1024):.4g} MiB"


__all__ = [
    "KERNEL_BLOCK",
    "GroupKind",
    "KVGroupSpec",
    "ModelConfigError",
    "ModelKV",
    "ModelUnsupported",
    "from_kv_cache_config",
    "group_rows",
    "predict",
]
