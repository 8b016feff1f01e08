"""``kvc top URL``: a live terminal view of a running server's KV Composer nodes.

Reads the server's Prometheus ``/metrics`` (the per-node series of
:mod:`composer.vllm.metrics`) every ``interval`` seconds and shows, per node:
requests looked up, hit rates per request and per prompt token (each request
counted once: vLLM may ask a node about one request several times, so hits
per lookup misread), tokens served (the chain's count: vLLM's own connectors
included), load and save bandwidth (bytes/s between
two scrapes), pool use, errors, whether it is switched off, and the plugin's own
counters (``self.stats.extra``: the largest first); and vLLM's own
prefix-cache hit rate and request queue. Standard library and ``rich`` only:
never torch or vLLM.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from composer import scrape


@dataclass
class Snapshot:
    at: float
    samples: list[scrape.Sample]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"  # pragma: no cover - the loop always returns


def _rate(now: Snapshot, before: Snapshot | None, node: str, key: str) -> str:
    if before is None or now.at <= before.at:
        return "-"
    a = scrape.nodes(before.samples).get(node)
    b = scrape.nodes(now.samples).get(node)
    if a is None or b is None:
        return "-"
    delta = b.counters.get(key, 0.0) - a.counters.get(key, 0.0)
    return f"{_size(max(delta, 0.0) / (now.at - before.at))}/s"


def _state(view: scrape.NodeView) -> Text:
    if view.disabled:
        return Text("disabled", style="bold red")
    if view.gauges.get("store_away"):
        return Text("store away", style="yellow")  # on, its lookups miss until it is back
    return Text("on", style="green")


def _own(view: scrape.NodeView, shown: int = 3) -> str:
    """The node's own counters (``self.stats.extra`` of its plugin), the largest first."""
    ranked = sorted(view.events.items(), key=lambda kv: (-kv[1], kv[0]))
    cells = [f"{k} {v:,.0f}" if float(v).is_integer() else f"{k} {v:.3g}" for k, v in ranked]
    more = f", +{len(cells) - shown} more" if len(cells) > shown else ""
    return ", ".join(cells[:shown]) + more


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _tenant_rows(table: Table, view: scrape.NodeView) -> None:
    """A row under the node for each tenant its quotas name (and ``*``, the rest)."""
    for tenant, per in sorted(view.tenants.items()):
        held, quota = per.get("blocks_held", 0.0), per.get("blocks_quota", 0.0)
        table.add_row(
            f"  tenant {tenant}",
            "",
            f"{per.get('requests', 0.0):,.0f}",
            "-",
            _percent(per.get("tokens_hit", 0.0), per.get("prompt_tokens", 0.0)),
            f"{per.get('tokens_hit', 0.0):,.0f}",
            "",
            "",
            f"{held:,.0f} of {quota:,.0f} blocks",
            "",
            "",
            f"blocks_evicted {per.get('blocks_evicted', 0.0):,.0f}",
        )


def render(now: Snapshot, before: Snapshot | None = None, source: str = "") -> Group:
    """The view of one scrape (``before``: the previous one, for the rates)."""
    views = scrape.nodes(now.samples)
    table = Table(
        title=f"KV Composer nodes — {source}" if source else "KV Composer nodes",
        caption="hit rates count each request once: requests the node served of those "
        "looked up in it, and prompt tokens it served of theirs",
    )
    for column, justify in (
        ("node", "left"),
        ("plugin", "left"),
        ("requests", "right"),
        ("req hit rate", "right"),
        ("token hit rate", "right"),
        ("tokens served", "right"),
        ("load/s", "right"),
        ("save/s", "right"),
        ("pool use", "right"),
        ("errors", "right"),
        ("state", "left"),
        ("own counters", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for node, view in sorted(views.items()):
        requests = view.counters.get("requests_looked_up", 0.0)
        prompt_tokens = view.counters.get("prompt_tokens_looked_up", 0.0)
        pool = view.gauges.get("pool_use")
        errors = view.counters.get("errors", 0.0)
        table.add_row(
            node,
            view.plugin,
            f"{requests:,.0f}",
            _percent(view.counters.get("requests_hit", 0.0), requests),
            _percent(view.counters.get("prompt_tokens_hit", 0.0), prompt_tokens),
            f"{view.counters.get('tokens_hit', 0.0):,.0f}",
            _rate(now, before, node, "bytes_loaded"),
            _rate(now, before, node, "bytes_saved"),
            f"{100 * pool:.1f}%" if pool is not None else "-",
            Text(f"{errors:,.0f}", style="red" if errors else ""),
            _state(view),
            _own(view),
        )
        _tenant_rows(table, view)
    queries = scrape.total(now.samples, "vllm:prefix_cache_queries_total")
    hits = scrape.total(now.samples, "vllm:prefix_cache_hits_total")
    running = scrape.total(now.samples, "vllm:num_requests_running")
    waiting = scrape.total(now.samples, "vllm:num_requests_waiting")
    usage = [s.value for s in now.samples if s.name == "vllm:kv_cache_usage_perc"]
    line = (
        f"vLLM: prefix cache hit rate {_percent(hits, queries)}, "
        f"KV cache use {f'{100 * max(usage):.1f}%' if usage else '-'}, "
        f"requests running {running:.0f}, waiting {waiting:.0f}"
    )
    if not views:
        line += "\n(no KV Composer nodes on this server's /metrics)"
    return Group(table, Text(line))


def run(
    url: str,
    *,
    interval: float = 2.0,
    once: bool = False,
    console: Console | None = None,
    fetch: Callable[[str], list[scrape.Sample]] = scrape.fetch,
    iterations: int | None = None,
) -> int:
    """Refresh the view every ``interval`` s until Ctrl-C (or ``iterations`` views);
    ``once``: two scrapes ``interval`` apart, one view printed."""
    # Piped (a log, a test): wide enough that no column is cut.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    before = Snapshot(time.monotonic(), fetch(url))
    if once:
        time.sleep(interval)
        console.print(render(Snapshot(time.monotonic(), fetch(url)), before, url))
        return 0
    shown = 0
    with Live(render(before, None, url), console=console, auto_refresh=False) as live:
        try:
            while iterations is None or shown < iterations:
                time.sleep(interval)
                now = Snapshot(time.monotonic(), fetch(url))
                live.update(render(now, before, url), refresh=True)
                before = now
                shown += 1
        except KeyboardInterrupt:
            pass
    return 0
