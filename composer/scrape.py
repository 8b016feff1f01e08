"""Read a Prometheus ``/metrics`` page (text format): standard library only, for ``kvc top``
and ``kvc bench`` (neither may import vLLM or prometheus_client)."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

#: The prefix of KV Composer's per-node series (composer.vllm.metrics.PREFIX).
PREFIX = "vllm:kv_composer_"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Samples of a text-format exposition (comments and malformed lines skipped)."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = {
            k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            for k, v in _LABEL.findall(labels or "")
        }
        out.append(Sample(name, pairs, number))
    return out


def fetch(url: str, timeout: float = 10) -> list[Sample]:
    """Scrape ``url`` (a server's base URL or its ``/metrics`` URL)."""
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse(resp.read().decode("utf-8", errors="replace"))


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of ``name`` over every series whose labels include ``labels``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class NodeView:
    """One node's series, summed over engines: counters by short name, gauges, events."""

    node: str
    plugin: str
    counters: dict[str, float]
    gauges: dict[str, float]
    events: dict[str, float]
    disabled: bool
    #: Per tenant (a node with quotas): its counters and gauges by name, summed.
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)


def nodes(samples: list[Sample]) -> dict[str, NodeView]:
    """KV Composer's per-node series by node id."""
    views: dict[str, NodeView] = {}
    counters: dict[str, dict[str, float]] = defaultdict(dict)
    for s in samples:
        if not s.name.startswith(PREFIX) or "node" not in s.labels:
            continue
        node = s.labels["node"]
        view = views.get(node)
        if view is None:
            view = views[node] = NodeView(node, s.labels.get("plugin", ""), {}, {}, {}, False)
        short = s.name[len(PREFIX) :]
        if short in ("tenant_total", "tenant_gauge"):
            name = s.labels.get("counter") or s.labels.get("gauge", "")
            per = view.tenants.setdefault(s.labels.get("tenant", ""), {})
            per[name] = per.get(name, 0.0) + s.value
        elif short == "gauge":
            view.gauges[s.labels.get("gauge", "")] = s.value
        elif short == "events_total":
            key = s.labels.get("event", "")
            view.events[key] = view.events.get(key, 0.0) + s.value
        elif short == "disabled":
            view.disabled = view.disabled or s.value > 0
        elif short.endswith("_total") and short != "hook_seconds_total":
            key = short[: -len("_total")]
            counters[node][key] = counters[node].get(key, 0.0) + s.value
    for node, values in counters.items():
        views[node].counters = values
    return views
