"""``kvc simulate``: replay a request trace through a model of a pipeline.

No engine runs and no KV byte moves: each request of the trace is a sequence
of block keys, looked up and stored in a model of every node, in arrival
order, one request at a time. The rules are the product's:

* a hit is the longest run of leading blocks present in the serving tier,
  counted from the end of vLLM's own prefix-cache hit (prefix semantics);
* only full blocks are cached, and at least one prompt token is always
  computed, so at most ``(prompt_tokens - 1) // block_size`` blocks are served;
* nodes are asked in ``load_order``; ``first_hit`` serves from the first node
  with a hit, ``longest_hit`` from the one with the most blocks (the first of
  equals); the serving node's blocks are touched (LRU) as it loads them;
* a request's blocks are stored when it finishes, into vLLM's own cache and
  into every ``save_to`` node, each by its ``save`` policy.

A plugin type brings its own model through ``PluginType.simulator``
(``"module:Class"``, imported here only), built on the code of the real tier
(``offload-cpu``'s model drives the tier's own ``BlockIndex``), so the
prediction cannot drift from the product. Nodes whose type has none are shown
as not modelled and never hit.

Traces are Mooncake's format (one JSON object a line: ``input_length``,
``output_length``, ``hash_ids``, one id per 512-token prompt block, equal
leading ids meaning an equal prefix). Each id stands for
``trace_block_tokens`` tokens (512 by default; fewer rescales every length by
the same factor, as a scaled replay on a CPU does). The partial last block of a
prompt and the output are unique to their request.
"""

from __future__ import annotations

import importlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from composer.pipeline import ResolvedNode, ResolvedPipeline

#: Tokens per hash id in Mooncake's traces.
MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_BLOCK_SIZE = 32
#: The row of vLLM's own prefix cache (not a valid node id, so it cannot clash with one).
VLLM_CACHE_ID = "<vllm>"
#: Bit that marks a key unique to one request (partial last prompt block, output).
_UNIQUE = 1 << 63
_OFFSET_BITS = 24


class TraceError(Exception):
    """A bad trace line: ``file:line: message``."""

    def __init__(self, file: str, line: int | None, message: str) -> None:
        self.file, self.line, self.message = file, line, message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {message}")


class SimulateError(Exception):
    """A usage problem of ``kvc simulate`` (bad option value)."""


# --------------------------------------------------------------------------- #
# traces
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, slots=True)
class TraceRequest:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    #: Arrival, milliseconds from the trace's start (0 where the line has none).
    timestamp_ms: float = 0.0


def _int_field(obj: dict[str, Any], name: str, file: str, line: int, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(file, line, f"{name}: expected an integer, got {json.dumps(value)}")
    if value < minimum:
        raise TraceError(file, line, f"{name}: must be >= {minimum}, got {value}")
    return value


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    file = str(path)
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise TraceError(file, None, f"cannot read trace: {exc.strerror or exc}") from None
    requests: list[TraceRequest] = []
    with handle:
        try:
            for number, text in enumerate(handle, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if not text.strip():
                    continue
                requests.append(_parse_line(text, file, number))
        except UnicodeDecodeError as exc:
            raise TraceError(file, None, f"not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise TraceError(file, None, "trace has no requests")
    return requests


def _parse_line(text: str, file: str, number: int) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(file, number, f"not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(file, number, "expected a JSON object")
    input_length = _int_field(obj, "input_length", file, number, 1)
    output_length = _int_field(obj, "output_length", file, number, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise TraceError(file, number, "hash_ids: expected a list of integers >= 0")
    expected = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceError(
            file,
            number,
            f"hash_ids: {len(ids)} ids for {input_length} input tokens; expected {expected} "
            f"(one per {MOONCAKE_BLOCK_TOKENS}-token block)",
        )
    stamp = obj.get("timestamp", 0)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
        raise TraceError(
            file, number, f"timestamp: expected a number >= 0, got {json.dumps(stamp)}"
        )
    return TraceRequest(input_length, output_length, tuple(ids), float(stamp))


class KeyMaker:
    """Block keys of trace requests for a given vLLM block size.

    The key of block ``k`` names the whole prefix ``[0, (k + 1) * block_size)``:
    the chain of hash ids up to the trace block holding its last token, and
    where in that trace block it ends. Equal prefixes give equal keys, in any
    request.
    """

    def __init__(self, block_size: int, trace_block_tokens: int) -> None:
        if block_size < 1 or trace_block_tokens < 1:
            raise SimulateError("block size and trace block tokens must be >= 1")
        if trace_block_tokens >= 1 << _OFFSET_BITS:
            raise SimulateError(f"trace block tokens must be < {1 << _OFFSET_BITS}")
        self.block_size = block_size
        self.trace_block_tokens = trace_block_tokens
        self._chains: dict[tuple[int, int], int] = {}
        self._unique = 0

    def scale(self, tokens: int) -> int:
        return tokens * self.trace_block_tokens // MOONCAKE_BLOCK_TOKENS

    def prompt_tokens(self, req: TraceRequest) -> int:
        full, rest = divmod(req.input_length, MOONCAKE_BLOCK_TOKENS)
        return full * self.trace_block_tokens + self.scale(rest)

    def keys(self, req: TraceRequest, num_tokens: int) -> list[bytes]:
        """Keys of the full blocks of the first ``num_tokens`` tokens of ``req``'s sequence."""
        bs, tbt = self.block_size, self.trace_block_tokens
        full_trace = req.input_length // MOONCAKE_BLOCK_TOKENS
        chains = self._chains
        chain_ids: list[int] = []
        parent = 0
        for hid in req.hash_ids[:full_trace]:
            pair = (parent, hid)
            cid = chains.get(pair)
            if cid is None:
                cid = chains[pair] = len(chains) + 1
            chain_ids.append(cid)
            parent = cid
        keys: list[bytes] = []
        shared_end = full_trace * tbt
        n = num_tokens // bs
        for k in range(n):
            end = (k + 1) * bs
            if end <= shared_end:
                j = (end - 1) // tbt
                value = (chain_ids[j] << _OFFSET_BITS) | (end - j * tbt)
            else:
                self._unique += 1
                value = _UNIQUE | self._unique
            keys.append(value.to_bytes(8, "little"))
        return keys


# --------------------------------------------------------------------------- #
# models
# --------------------------------------------------------------------------- #


class TierModel(Protocol):
    """What a plugin's simulation model provides (``PluginType.simulator``).

    Built as ``Model(config, block_size=..., bytes_per_block=...)``.
    """

    @property
    def capacity_blocks(self) -> int:
        """Blocks the tier holds when full."""
        ...

    @property
    def evictions(self) -> int:
        """Blocks dropped to make room so far."""
        ...

    def lookup(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        """How many blocks from ``start`` (below ``limit``) it would serve now."""
        ...

    def load(self, keys: Sequence[bytes]) -> None:
        """It serves these blocks (touch them as the tier does at load)."""
        ...

    def save(self, keys: Sequence[bytes], prompt_blocks: int) -> int:
        """A finished request's full blocks (``keys[:prompt_blocks]`` are the prompt's);
        returns how many blocks it newly stored."""
        ...


class PrefixCacheModel:
    """vLLM's own prefix cache: ``num_blocks`` blocks, least recently freed evicted first.

    vLLM frees a finished request's blocks last block first, so a request's
    tail is evicted before its head; the order of its free queue is kept here.
    """

    def __init__(self, num_blocks: int) -> None:
        self.capacity_blocks = num_blocks
        self.evictions = 0
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        lru = self._lru
        hit = 0
        for k in range(start, limit):
            if keys[k] not in lru:
                break
            hit += 1
        return hit

    def finish(self, keys: Sequence[bytes]) -> None:
        if not self.capacity_blocks:
            return
        lru = self._lru
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
            self.evictions += 1


def load_model_class(spec: str) -> type:
    module, _, attr = spec.partition(":")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


# --------------------------------------------------------------------------- #
# replay
# --------------------------------------------------------------------------- #


@dataclass
class NodeResult:
    id: str
    plugin: str
    modelled: bool
    lookup: bool = False
    save: bool = False
    capacity_blocks: int | None = None
    capacity_bytes: int | None = None
    lookups: int = 0
    hits: int = 0
    served_requests: int = 0
    tokens_served: int = 0
    blocks_loaded: int = 0
    blocks_saved: int = 0
    evictions: int = 0
    fraction_served: float = 0.0
    bytes_loaded: int = 0
    bytes_saved: int = 0


@dataclass
class Result:
    trace: str
    requests: int
    prompt_tokens: int
    block_size: int
    unit_blocks: int
    trace_block_tokens: int
    bytes_per_block: int
    load_policy: str
    nodes: list[NodeResult] = field(default_factory=list)
    tokens_served: int = 0
    prefill_tokens_computed: int = 0
    fraction_served: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "block_size": self.block_size,
            "unit_blocks": self.unit_blocks,
            "trace_block_tokens": self.trace_block_tokens,
            "bytes_per_block": self.bytes_per_block,
            "load_policy": self.load_policy,
            "nodes": [vars(n) for n in self.nodes],
            "total": {
                "tokens_served": self.tokens_served,
                "fraction_served": self.fraction_served,
                "prefill_tokens_saved": self.tokens_served,
                "prefill_tokens_computed": self.prefill_tokens_computed,
            },
        }


def _label(node: ResolvedNode) -> str:
    if node.plugin.name == "vllm":
        return f"vllm ({getattr(node.config, 'connector', '?')})"
    return str(node.plugin.name)


def simulate(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    *,
    bytes_per_block: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vllm_cache_blocks: int = 0,
    trace_name: str = "<trace>",
    overrides: dict[str, Any] | None = None,
    exact: bool = False,
) -> Result:
    """Replay ``trace`` through ``pipeline``; ``overrides`` replaces config fields of
    every modelled node that has them (a sweep's point).

    Unless ``exact``, when the block size divides a trace block the replay moves
    whole trace blocks (``trace_block_tokens // block_size`` vLLM blocks, one
    unit): every block of a trace block is looked up, stored, touched and
    evicted together, 16x less work for Mooncake's 512 tokens in 32-token
    blocks. A tier then holds whole units only, and the full blocks of a
    prompt's partial last trace block (never a hit: unique to the request) are
    not stored. ``exact`` replays every vLLM block.
    """
    if bytes_per_block < 1:
        raise SimulateError("bytes per block must be >= 1")
    if block_size < 1:
        raise SimulateError("--block-size must be >= 1")
    if trace_block_tokens < 1:
        raise SimulateError("--trace-block-tokens must be >= 1")
    if vllm_cache_blocks < 0:
        raise SimulateError("--vllm-cache-blocks must be >= 0")
    group = 1
    if not exact and trace_block_tokens % block_size == 0:
        group = trace_block_tokens // block_size
    unit = block_size * group
    unit_bytes = bytes_per_block * group
    keymaker = KeyMaker(unit, trace_block_tokens)
    results: dict[str, NodeResult] = {}
    models: dict[str, TierModel] = {}
    for node in pipeline.nodes:
        spec = getattr(node.plugin, "simulator", None)
        res = NodeResult(node.id, _label(node), modelled=spec is not None)
        res.lookup = node.id in pipeline.load_order
        res.save = node.id in pipeline.save_to
        results[node.id] = res
        if spec is None:
            continue
        config = _with_overrides(node, overrides or {})
        model: TierModel = load_model_class(spec)(
            config, block_size=unit, bytes_per_block=unit_bytes
        )
        models[node.id] = model
        res.capacity_blocks = model.capacity_blocks * group
        res.capacity_bytes = model.capacity_blocks * unit_bytes
    vllm = PrefixCacheModel(vllm_cache_blocks // group)
    vllm_res = NodeResult(VLLM_CACHE_ID, "vllm prefix cache", modelled=True)
    vllm_res.lookup = vllm_res.save = vllm_cache_blocks > 0
    vllm_res.capacity_blocks = vllm.capacity_blocks * group
    vllm_res.capacity_bytes = vllm.capacity_blocks * unit_bytes

    lookup_nodes = [(n, models[n], results[n]) for n in pipeline.load_order if n in models]
    save_nodes = [(models[n], results[n]) for n in pipeline.save_to if n in models]
    longest = pipeline.load_policy == "longest_hit"
    prompt_total = served_total = 0

    for req in trace:
        prompt = keymaker.prompt_tokens(req)
        total = prompt + keymaker.scale(req.output_length)
        # KV exists for every token but the last sampled one.
        keys = keymaker.keys(req, max(prompt, total - 1))
        prompt_blocks = min(prompt // unit, len(keys))
        limit = (prompt - 1) // unit
        prompt_total += prompt
        start = vllm.lookup(keys, 0, limit) if vllm_cache_blocks else 0
        if start:
            vllm_res.hits += 1
            vllm_res.served_requests += 1
            vllm_res.tokens_served += start * unit
        vllm_res.lookups += vllm_cache_blocks > 0
        chosen: tuple[TierModel, NodeResult, int] | None = None
        for _, model, res in lookup_nodes:
            res.lookups += 1
            hit = model.lookup(keys, start, limit)
            if hit > 0:
                res.hits += 1
                if chosen is None or (longest and hit > chosen[2]):
                    chosen = (model, res, hit)
        served = start
        if chosen is not None:
            model, res, hit = chosen
            model.load(keys[start : start + hit])
            res.served_requests += 1
            res.tokens_served += hit * unit
            res.blocks_loaded += hit * group
            served += hit
        served_total += served * unit
        if vllm_cache_blocks:
            vllm.finish(keys)
        for model, res in save_nodes:
            res.blocks_saved += model.save(keys, prompt_blocks) * group

    for node_id, model in models.items():
        results[node_id].evictions = model.evictions * group
    vllm_res.evictions = vllm.evictions * group
    nodes = ([vllm_res] if vllm_cache_blocks else []) + [results[n.id] for n in pipeline.nodes]
    for res in nodes:
        res.fraction_served = res.tokens_served / prompt_total if prompt_total else 0.0
        res.bytes_loaded = res.blocks_loaded * bytes_per_block
        res.bytes_saved = res.blocks_saved * bytes_per_block
    return Result(
        trace=trace_name,
        requests=len(trace),
        prompt_tokens=prompt_total,
        block_size=block_size,
        unit_blocks=group,
        trace_block_tokens=trace_block_tokens,
        bytes_per_block=bytes_per_block,
        load_policy=pipeline.load_policy,
        nodes=nodes,
        tokens_served=served_total,
        prefill_tokens_computed=prompt_total - served_total,
        fraction_served=served_total / prompt_total if prompt_total else 0.0,
    )


def _with_overrides(node: ResolvedNode, overrides: dict[str, Any]) -> BaseModel:
    fields = {k: v for k, v in overrides.items() if k in type(node.config).model_fields}
    if not fields:
        return node.config
    data = node.config.model_dump()
    data.update(fields)
    try:
        return type(node.config).model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SimulateError(
            f"--sweep: node {node.id!r}: {'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from None


# --------------------------------------------------------------------------- #
# model sizes
# --------------------------------------------------------------------------- #

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


# --------------------------------------------------------------------------- #
# output
# --------------------------------------------------------------------------- #


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n}B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f}{unit}"


def format_result(result: Result) -> str:
    lines = [
        f"trace {result.trace}: {result.requests:,} requests, {result.prompt_tokens:,} prompt "
        f"tokens; block {result.block_size} tokens of {result.bytes_per_block:,} bytes; "
        f"1 trace id = {result.trace_block_tokens} tokens; load_policy {result.load_policy}",
        f"replayed in units of {result.unit_blocks} block{'s' * (result.unit_blocks != 1)}"
        + (" (one trace id; --exact for every block)" if result.unit_blocks > 1 else ""),
        "",
    ]
    header = ("node", "plugin", "capacity", "served", "hits", "tokens served", "loaded",
              "saved", "evictions")
    rows: list[tuple[str, ...]] = []
    for n in result.nodes:
        if not n.modelled:
            rows.append((n.id, n.plugin, "not modelled", "-", "-", "-", "-", "-", "-"))
            continue
        cap = f"{_size(n.capacity_bytes)} ({n.capacity_blocks:,} blocks)"
        rows.append((
            n.id, n.plugin, cap,
            f"{100 * n.fraction_served:.1f}%" if n.lookup else "-",
            f"{n.served_requests:,}/{n.lookups:,}" if n.lookup else "-",
            f"{n.tokens_served:,}",
            _size(n.bytes_loaded) if n.id != VLLM_CACHE_ID else "-",
            _size(n.bytes_saved) if n.save and n.id != VLLM_CACHE_ID else "-",
            f"{n.evictions:,}",
        ))
    rows.append((
        "total", "", "", f"{100 * result.fraction_served:.1f}%", "", f"{result.tokens_served:,}",
        _size(sum(n.bytes_loaded for n in result.nodes if n.id != VLLM_CACHE_ID)),
        _size(sum(n.bytes_saved for n in result.nodes if n.id != VLLM_CACHE_ID)), "",
    ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines += [
        "",
        f"prefill tokens saved {result.tokens_served:,} of {result.prompt_tokens:,}; "
        f"computed {result.prefill_tokens_computed:,}",
    ]
    unmodelled = [n.id for n in result.nodes if not n.modelled]
    if unmodelled:
        lines.append(
            f"not modelled (no simulator for their plugin; counted as misses): "
            f"{', '.join(unmodelled)}"
        )
    return "\n".join(lines)


def parse_sweep(text: str) -> tuple[str, list[str]]:
    name, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.strip() or not items:
        raise SimulateError(f"--sweep: expected FIELD=V1,V2,..., got {text!r}")
    return name.strip(), items


def sweep(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    field_name: str,
    values: Sequence[str],
    **kwargs: Any,
) -> list[Result]:
    touched = [
        n.id for n in pipeline.nodes
        if getattr(n.plugin, "simulator", None) and field_name in type(n.config).model_fields
    ]
    if not touched:
        raise SimulateError(f"--sweep: no modelled node has a config field {field_name!r}")
    return [
        simulate(pipeline, trace, overrides={field_name: v}, **kwargs) for v in values
    ]


def format_sweep(field_name: str, values: Sequence[str], results: Sequence[Result]) -> str:
    ids = [n.id for n in results[0].nodes if n.modelled and n.lookup]
    header = (field_name, *ids, "total")
    rows = [
        (v, *(f"{100 * _node(r, i).fraction_served:.1f}%" for i in ids),
         f"{100 * r.fraction_served:.1f}%")
        for v, r in zip(values, results, strict=True)
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["fraction of prompt tokens served"]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _node(result: Result, node_id: str) -> NodeResult:
    return next(n for n in result.nodes if n.id == node_id)


def plot_sweep(
    path: Path, field_name: str, values: Sequence[str], results: Sequence[Result]
) -> None:
    """Hit rate (fraction of prompt tokens served) against the swept value, per node."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SimulateError(
            f"--sweep's plot needs matplotlib ({exc}); install 'kv-composer[plot]'"
        ) from None
    ids = [n.id for n in results[0].nodes if n.modelled and n.lookup]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = list(range(len(values)))
    for node_id in ids:
        ax.plot(xs, [100 * _node(r, node_id).fraction_served for r in results], marker="o",
                label="vLLM prefix cache" if node_id == VLLM_CACHE_ID else node_id)
    ax.plot(xs, [100 * r.fraction_served for r in results], marker="s", linestyle="--",
            color="black", label="total")
    ax.set_xticks(xs, list(values))
    ax.set_xlabel(field_name)
    ax.set_ylabel("prompt tokens served (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"kvc simulate: {results[0].trace} ({results[0].requests:,} requests)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise SimulateError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
