"""``kvc simulate``'s output: the per-node table, the sweep table and the sweep's plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from composer.simulate.replay import NodeResult, Result
from composer.simulate.tiers import VLLM_CACHE_ID, SimulateError


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
    ]
    if len(result.groups) > 1 or any(g.window for g in result.groups):
        lines.append(
            "KV cache groups: " + ", ".join(
                g.kind + (f" (window {g.window})" if g.window else "")
                + (f" {_size(g.block_bytes)}/block" if g.block_bytes else "")
                for g in result.groups
            ) + (f"; a slot holds one group's block ({_size(result.bytes_per_block)})"
                 if len(result.groups) > 1 else "")
        )
    lines += [f"note: {n}" for n in result.notes]
    lines.append("")
    lines += _node_table(result)
    lines += [
        "",
        f"prefill tokens saved {result.tokens_served:,} of {result.prompt_tokens:,}; "
        f"computed {result.prefill_tokens_computed:,}",
    ]
    if result.tenants:
        lines += ["", *_tenant_table(result)]
    for n in result.nodes:
        if n.window_saving is not None:
            lines.append(
                f"{n.id}: window saving {100 * n.window_saving:.1f}% (bytes it keeps of the "
                "requests' blocks, of what a full-attention model of this shape would keep)"
            )
        if n.note:
            lines.append(f"{n.id}: serves no hits: {n.note}")
    unmodelled = [n.id for n in result.nodes if not n.modelled]
    if unmodelled:
        lines.append(
            f"not modelled (no simulator for their plugin; counted as misses): "
            f"{', '.join(unmodelled)}"
        )
    return "\n".join(lines)


def _tenant_table(result: Result) -> list[str]:
    """One row per tenant (the trace's ``tenant``, "" shown as -): what was served of
    its prompts, by vLLM's prefix cache and every node together."""
    rows = [("tenant", "requests", "prompt tokens", "tokens served", "served")]
    for name, t in sorted(result.tenants.items()):
        rows.append((
            name or "-", f"{t.requests:,}", f"{t.prompt_tokens:,}", f"{t.tokens_served:,}",
            f"{100 * t.fraction_served:.1f}%",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _node_table(result: Result) -> list[str]:
    """One row per node (what it served, loaded, saved), then the totals."""
    header = ("node", "plugin", "capacity", "served", "hits", "tokens served", "loaded",
              "saved", "saved/request", "evictions")
    rows: list[tuple[str, ...]] = []
    for n in result.nodes:
        if not n.modelled:
            rows.append((n.id, n.plugin, "not modelled", "-", "-", "-", "-", "-", "-", "-"))
            continue
        cap = f"{_size(n.capacity_bytes)} ({n.capacity_blocks:,} blocks)"
        rows.append((
            n.id, n.plugin, cap,
            f"{100 * n.fraction_served:.1f}%" if n.lookup else "-",
            f"{n.served_requests:,}/{n.lookups:,}" if n.lookup else "-",
            f"{n.tokens_served:,}",
            _size(n.bytes_loaded) if n.id != VLLM_CACHE_ID else "-",
            _size(n.bytes_saved) if n.save and n.id != VLLM_CACHE_ID else "-",
            _size(round(n.bytes_saved_per_request)) if n.save and n.id != VLLM_CACHE_ID else "-",
            f"{n.evictions:,}",
        ))
    rows.append((
        "total", "", "", f"{100 * result.fraction_served:.1f}%", "", f"{result.tokens_served:,}",
        _size(sum(n.bytes_loaded for n in result.nodes if n.id != VLLM_CACHE_ID)),
        _size(sum(n.bytes_saved for n in result.nodes if n.id != VLLM_CACHE_ID)), "", "",
    ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
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
