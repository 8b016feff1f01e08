"""`kvc top`: the view of a recorded real /metrics payload, and its rates between scrapes."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from composer import scrape
from composer.cli import top

RECORDED = Path(__file__).parent / "data" / "metrics" / "kvc-serve-offload-cpu.prom"


def _text(renderable: object, width: int = 160) -> str:
    out = io.StringIO()
    Console(file=out, width=width).print(renderable)
    return out.getvalue()


def test_parse_reads_labels_values_and_escapes() -> None:
    samples = scrape.parse(
        '# HELP x y\nx_total{a="1",b="q\\"uote"} 3.5\nplain 2\nbad line\ny{a="z"} NaN\n'
    )
    assert samples[0] == scrape.Sample("x_total", {"a": "1", "b": 'q"uote'}, 3.5)
    assert samples[1] == scrape.Sample("plain", {}, 2.0)
    assert len(samples) == 3


def test_recorded_payload_gives_each_nodes_series() -> None:
    nodes = scrape.nodes(scrape.parse(RECORDED.read_text()))
    cpu = nodes["cpu"]
    assert cpu.plugin == "offload-cpu"
    assert cpu.counters["lookups"] == 4 and cpu.counters["hits"] == 2
    assert cpu.counters["tokens_loaded"] == 480
    assert cpu.events["misses"] == 1
    assert 0 < cpu.gauges["pool_use"] < 0.01
    assert not cpu.disabled


def _with_per_request_series(text: str, **counts: float) -> str:
    """``text`` with the per-request counters of its ``cpu`` node (the recording predates
    them), and its ``tokens_hit`` as the chain counts it now: the tokens served (the
    recording counted each lookup's hit: 960 for the 480 served)."""
    text = text.replace("tokens_hit_total{", "tokens_hit_recorded_total{")
    counts.setdefault("tokens_hit", 480)
    labels = '{engine="0",model_name="m",node="cpu",plugin="offload-cpu"}'
    lines = [f"{scrape.PREFIX}{name}_total{labels} {value}" for name, value in counts.items()]
    return text + "\n".join(lines) + "\n"


def _cpu_cells(text: str) -> list[str]:
    row = next(line for line in text.splitlines() if " cpu " in line)
    return [c.strip() for c in row.strip("│ \n").split("│")]


def test_view_shows_hit_rates_per_request_and_per_token_tokens_and_pool_use() -> None:
    # The recorded run: two requests with one 512-token prompt, the second served
    # 480 tokens by the tier (vLLM's external_prefix_cache_hits_total in the same
    # payload), though the node was looked up 4 times and hit twice.
    text = _with_per_request_series(
        RECORDED.read_text(),
        requests_looked_up=2,
        requests_hit=1,
        prompt_tokens_looked_up=1024,
        prompt_tokens_hit=480,
    )
    samples = scrape.parse(text)
    view = _text(top.render(top.Snapshot(0.0, samples), None, "recorded"))
    cells = _cpu_cells(view)
    assert cells[:6] == ["cpu", "offload-cpu", "2", "50.0%", "46.9%", "480"]
    assert cells[6:8] == ["-", "-"]  # no rate from a single scrape
    assert cells[8] == "0.4%" and cells[10] == "on"
    assert "each request once" in view


def test_a_node_no_request_reached_has_no_hit_rate() -> None:
    # A server before its first request, or one whose /metrics predates the series.
    zeros = dict.fromkeys(
        ("requests_looked_up", "requests_hit", "prompt_tokens_looked_up", "prompt_tokens_hit"), 0
    )
    for text in (_with_per_request_series(RECORDED.read_text(), **zeros), RECORDED.read_text()):
        view = _text(top.render(top.Snapshot(0.0, scrape.parse(text))))
        assert _cpu_cells(view)[2:5] == ["0", "-", "-"]


def test_rates_are_bytes_per_second_between_two_scrapes() -> None:
    text = RECORDED.read_text()
    before = scrape.parse(text)
    name = "vllm:kv_composer_bytes_loaded_total{"
    line = next(x for x in text.splitlines() if x.startswith(name))
    later = text.replace(line, line.rsplit(" ", 1)[0] + f" {245760 + 2 * 1024 * 1024}.0")
    view = top.render(top.Snapshot(10.0, scrape.parse(later)), top.Snapshot(8.0, before))
    row = next(x for x in _text(view).splitlines() if " cpu " in x)
    assert "1.0 MiB/s" in row  # 2 MiB more in 2 s


def test_once_prints_one_view_from_two_scrapes() -> None:
    calls: list[str] = []

    def fetch(url: str) -> list[scrape.Sample]:
        calls.append(url)
        return scrape.parse(RECORDED.read_text())

    out = io.StringIO()
    code = top.run(
        "http://x", interval=0.01, once=True, console=Console(file=out, width=160), fetch=fetch
    )
    assert code == 0 and calls == ["http://x", "http://x"]
    assert "offload-cpu" in out.getvalue() and "0 B/s" in out.getvalue()


def test_top_scrape_and_replay_import_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, composer.cli.top, composer.bench.replay, composer.bench.run, composer.scrape, "
        "composer.cli, composer.simulate, composer.simulate.report, composer.simulate.shape; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_kvc_top_reports_an_unreachable_server_with_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "composer.cli", "top", "http://127.0.0.1:9", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot scrape http://127.0.0.1:9" in proc.stderr and "Traceback" not in proc.stderr


def test_the_state_says_disabled_store_away_or_on() -> None:
    labels = 'engine="0",model_name="m",node="cpu",plugin="offload-cpu"'
    states = {
        "on": "",
        "store away": f'{scrape.PREFIX}gauge{{{labels},gauge="store_away"}} 1\n',
        "disabled": f"{scrape.PREFIX}disabled{{{labels}}} 1\n"
        f'{scrape.PREFIX}gauge{{{labels},gauge="store_away"}} 1\n',
    }
    for state, extra in states.items():
        samples = scrape.parse(RECORDED.read_text() + extra)
        cells = _cpu_cells(_text(top.render(top.Snapshot(0.0, samples), None, "recorded")))
        assert cells[10] == state


def test_a_plugins_own_counters_are_shown_largest_first() -> None:
    # The docs' one-file plugin (docs/plugins.md) counts "prompts":
    # self.stats.extra.add("prompts").
    def own(event: str, value: int) -> str:
        labels = f'event="{event}",engine="0",model_name="m",node="cpu",plugin="offload-cpu"'
        return f"vllm:kv_composer_events_total{{{labels}}} {value}\n"

    samples = scrape.parse(RECORDED.read_text() + own("prompts", 12) + own("hits_a", 2))
    cells = _cpu_cells(_text(top.render(top.Snapshot(0.0, samples)), width=240))
    assert cells[11] == "prompts 12, hits_a 2, misses 1, +2 more"
    assert scrape.nodes(samples)["cpu"].events["prompts"] == 12


def test_each_tenant_of_a_node_with_quotas_has_a_row_and_leaves_the_nodes_counts_alone() -> None:
    labels = 'engine="0",model_name="m",node="cpu",plugin="offload-cpu"'
    series = {
        ("chat", "counter", "requests"): 4,
        ("chat", "counter", "prompt_tokens"): 2048,
        ("chat", "counter", "tokens_hit"): 512,
        ("chat", "counter", "blocks_evicted"): 3,
        ("chat", "gauge", "blocks_held"): 12,
        ("chat", "gauge", "blocks_quota"): 40,
        ("*", "counter", "requests"): 1,
    }
    lines = [
        f'{scrape.PREFIX}{"tenant_total" if kind == "counter" else "tenant_gauge"}'
        f'{{{labels},tenant="{tenant}",{kind}="{name}"}} {value}'
        for (tenant, kind, name), value in series.items()
    ]
    text = _with_per_request_series(RECORDED.read_text()) + "\n".join(lines) + "\n"
    cpu = scrape.nodes(scrape.parse(text))["cpu"]
    assert cpu.tenants["chat"]["tokens_hit"] == 512 and cpu.tenants["*"] == {"requests": 1}
    assert "tenant" not in cpu.counters and cpu.counters["tokens_hit"] == 480
    view = _text(top.render(top.Snapshot(0.0, scrape.parse(text))), width=240)
    row = next(line for line in view.splitlines() if "tenant chat" in line)
    cells = [c.strip() for c in row.strip("│ \n").split("│")]
    assert cells[2:6] == ["4", "-", "25.0%", "512"]
    assert cells[8] == "12 of 40 blocks" and cells[-1] == "blocks_evicted 3"
