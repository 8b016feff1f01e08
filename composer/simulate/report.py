"""``kvc simulate``'s text and plots: one run's per-node table (:func:`format_result`, with
its tenants and the cache policies switched off), a fleet's table per router
(:func:`format_fleet`), and the sweeps' tables and plots, of one engine and of a fleet
(plots need matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer.simulate.fleet import PERCENTILES, FleetResult
from composer.simulate.results import NodeResult, Result, TenantResult
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
    lines += _failures(result.policy_failures)
    lines += [
        "",
        f"prefill tokens saved {result.tokens_served:,} of {result.prompt_tokens:,}; "
        f"computed {result.prefill_tokens_computed:,}",
    ]
    if result.tenants:
        lines += ["", *_tenant_table(result.tenants)]
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


def _failures(failures: Sequence[str]) -> list[str]:
    """Each cache policy switched off in the run, right under the figures it changed:
    from that eviction on they are its fallback's, not the configured policy's."""
    if not failures:
        return []
    return [
        "cache policies switched off (they raised; the figures after that are the "
        "fallback's, not theirs):",
        *(f"  {line}" for line in failures),
    ]


def _tenant_table(tenants: dict[str, TenantResult]) -> list[str]:
    """One row per tenant (the trace's ``tenant``, "" shown as -): what was served of
    its prompts, by vLLM's prefix cache and every node together."""
    rows = [("tenant", "requests", "prompt tokens", "tokens served", "served")]
    for name, t in sorted(tenants.items()):
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
    lines += _failures([
        f"{field_name}={v}: {line}"
        for v, r in zip(values, results, strict=True)
        for line in r.policy_failures
    ])
    return "\n".join(lines)


def _node(result: Result, node_id: str) -> NodeResult:
    return next(n for n in result.nodes if n.id == node_id)


def plot_sweep(
    path: Path, field_name: str, values: Sequence[str], results: Sequence[Result]
) -> None:
    """Hit rate (fraction of prompt tokens served) against the swept value, per node."""
    plt = _pyplot()
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
    _save(plt, fig, path)


def _pyplot() -> Any:
    try:
        # Deferred: matplotlib is optional and heavy; only a sweep's plot needs it.
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SimulateError(
            f"--sweep's plot needs matplotlib ({exc}); install 'kv-composer[plot]'"
        ) from None
    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise SimulateError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _grid(
    field_name: str, values: Sequence[str], routers: Sequence[str], results: Sequence[FleetResult]
) -> list[list[FleetResult]]:
    """A fleet sweep's results by value, then router (as
    :func:`~composer.simulate.sweep.fleet_runs` orders them)."""
    n = len(routers)
    return [list(results[i * n:(i + 1) * n]) for i in range(len(values))]


def format_fleet_sweep(
    field_name: str, values: Sequence[str], routers: Sequence[str], results: Sequence[FleetResult]
) -> str:
    """Per value and router: the fraction served, the imbalance, TTFT percentiles."""
    header = (field_name, "router", "served", "imbalance", *(f"TTFT p{p} ms" for p in PERCENTILES))
    rows: list[tuple[str, ...]] = []
    for value, row in zip(values, _grid(field_name, values, routers, results), strict=True):
        for r in row:
            rows.append((
                value, r.router, f"{100 * r.fraction_served:.1f}%",
                "-" if r.imbalance is None else f"{r.imbalance:.2f}",
                *(f"{1000 * r.ttft_s[p]:,.0f}" if p in r.ttft_s else "-" for p in PERCENTILES),
            ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    first = results[0]
    lines = [f"fleet sweep: {first.requests:,} requests, arrivals: {first.arrivals}"]
    for cells in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    lines += _failures([
        f"{field_name}={value}, {r.router}, {line}"
        for value, row in zip(values, _grid(field_name, values, routers, results), strict=True)
        for r in row
        for line in r.policy_failures
    ])
    return "\n".join(lines)


def plot_fleet_sweep(
    path: Path, field_name: str, values: Sequence[str], routers: Sequence[str],
    results: Sequence[FleetResult], trace: str,
) -> None:
    """Fraction served and TTFT p90 against the swept value, one line per router."""
    plt = _pyplot()
    grid = _grid(field_name, values, routers, results)
    fig, (served, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    xs = list(range(len(values)))
    for i, router in enumerate(routers):
        served.plot(xs, [100 * row[i].fraction_served for row in grid], marker="o", label=router)
        ttft.plot(xs, [1000 * row[i].ttft_s.get(90, 0.0) for row in grid], marker="o",
                  label=router)
    for ax, label in ((served, "prompt tokens served (%)"), (ttft, "TTFT p90 (ms)")):
        ax.set_xticks(xs, list(values))
        ax.set_xlabel(field_name)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    served.set_ylim(0, 100)
    ttft.set_yscale("log")
    served.legend(fontsize="small")
    fig.suptitle(f"kvc simulate --fleet: {trace} ({results[0].requests:,} requests, "
                 f"{results[0].arrivals})")
    _save(plt, fig, path)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f}"


def format_fleet(results: Sequence[FleetResult]) -> str:
    """One row per router: requests by engine, imbalance, what served the prompts, TTFT;
    then each engine's queueing (up to 8 engines; --json has every engine)."""
    nodes = sorted({n for r in results for n in r.tokens_served}, key=lambda n: n != VLLM_CACHE_ID)
    header = [
        "router", "requests by engine (busiest first)", "imbalance", *nodes, "total served",
        *(f"TTFT p{p} ms" for p in PERCENTILES), "in flight (mean, busiest)",
    ]
    rows = [header]
    for r in results:
        imbalance = "-" if r.imbalance is None else f"{r.imbalance:.2f}"
        busiest = max(r.per_engine, key=lambda e: e.mean_in_flight, default=None)
        by_engine = r.engine_requests
        shown = "/".join(map(str, by_engine)) if len(by_engine) <= 16 else (
            f"{by_engine[0]}/{by_engine[1]}/.../{by_engine[-1]} ({len(by_engine)} engines)"
        )
        rows.append(
            [
                r.router,
                shown,
                imbalance,
                *(f"{100 * r.fraction(n):.1f}%" for n in nodes),
                f"{100 * r.fraction_served:.1f}%",
                *(_ms(r.ttft_s.get(p)) for p in PERCENTILES),
                "-" if busiest is None else f"{busiest.mean_in_flight:.2f}",
            ]
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    first = results[0] if results else None
    lines = [
        f"{first.engines} engines, {first.requests:,} requests, {first.prompt_tokens:,} prompt "
        f"tokens, arrivals: {first.arrivals} (vLLM's prefix cache is the <vllm> column)"
        if first
        else ""
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    lines += _failures([f"{r.router}, {line}" for r in results for line in r.policy_failures])
    for r in results:
        if 0 < len(r.tenants) <= 8:  # more: --json has them
            lines += ["", f"{r.router}, per tenant:", *_tenant_table(r.tenants)]
        if len(r.per_engine) > 8:
            continue
        lines.append(f"\n{r.router}, per engine: requests, served, mean/max in flight, mean wait")
        for i, e in enumerate(r.per_engine):
            lines.append(
                f"  engine {i}: {e.requests:,} requests, {100 * e.fraction_served:.1f}% served, "
                f"{e.mean_in_flight:.2f}/{e.max_in_flight} in flight, "
                f"wait {_ms(e.mean_wait_s)} ms"
            )
    return "\n".join(lines)
