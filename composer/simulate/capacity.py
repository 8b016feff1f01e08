"""``kvc simulate --fleet N --ttft-p90-below T``: the fewest engines, from 1 to N, whose
simulated TTFT p90 is below T, for each router policy.

A fleet's TTFT p90 falls as engines are added, nearly always (a router may place a few
requests worse with one more engine), so the count is found by bisection over 1..N: N
first (if even N misses T, the answer is "more than N"), then the middle of the range
still open, about log2(N) + 1 runs a policy. Each step runs one fleet per policy still
searching, side by side (:func:`composer.simulate.sweep.simulate_many`), with the
arrivals, sizes and costs of every other run. The search *assumes* the p90 is monotone
in the engine count; what it reports holds whatever: the count found meets T and one
fewer does not, both simulated (where the p90 is not monotone, a smaller count may
meet T too). Its plot is the sweep's: TTFT p90 and the fraction served against the
engine count, one line per policy through the counts it ran.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.pipeline import ResolvedPipeline
from composer.simulate.fleet import FleetResult
from composer.simulate.report import _pyplot, _save
from composer.simulate.sweep import check_engines, simulate_many
from composer.simulate.tiers import SimulateError
from composer.trace import TraceRequest

#: The option that asks the question.
OPTION = "--ttft-p90-below"


def check_target(seconds: float) -> float:
    """``seconds`` as a TTFT p90 target: a finite number > 0, or the option's error."""
    if not 0 < seconds < math.inf:  # (NaN fails both)
        raise SimulateError(f"{OPTION} must be a finite number of seconds > 0, got {seconds}")
    return seconds


@dataclass
class EnginesNeeded:
    """One policy's answer, and every run of its search."""

    router: str
    target_s: float
    #: The most engines tried (``--fleet N``).
    most: int
    #: The search's runs, by engine count.
    runs: dict[int, FleetResult] = field(default_factory=dict)
    #: The fewest engines whose TTFT p90 is below the target; None: more than ``most``.
    engines: int | None = None

    def p90(self, engines: int) -> float | None:
        """The TTFT p90 of the run with ``engines`` engines, seconds (None: not run)."""
        run = self.runs.get(engines)
        return None if run is None else _p90(run)

    @property
    def one_fewer(self) -> int | None:
        """The count whose miss the answer rests on: one fewer than the answer (None for
        one engine), or ``most`` when even that missed."""
        if self.engines is None:
            return self.most
        return self.engines - 1 if self.engines > 1 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "ttft_p90_below_s": self.target_s,
            "most_engines": self.most,
            "engines": self.engines,
            "ttft_p90_s": None if self.engines is None else self.p90(self.engines),
            "one_fewer": self.one_fewer,
            "one_fewer_ttft_p90_s": None if self.one_fewer is None else self.p90(self.one_fewer),
            "runs": [
                {"engines": n, "ttft_p90_s": _p90(r), "fraction_served": r.fraction_served}
                for n, r in sorted(self.runs.items())
            ],
        }


def _p90(result: FleetResult) -> float:
    return result.ttft_s.get(90, math.inf)


class _Bisection:
    """One policy's search: ``low`` the most engines known to miss (0: none tried),
    ``high`` the fewest known to meet (None: none yet)."""

    def __init__(self, most: int) -> None:
        self.most, self.low = most, 0
        self.high: int | None = None

    def next(self) -> int | None:
        """The next count to run, or None when the answer is known."""
        if self.high is None:
            return None if self.low == self.most else self.most
        return None if self.high - self.low <= 1 else (self.low + self.high) // 2

    def record(self, engines: int, meets: bool) -> None:
        if meets:
            self.high = engines
        else:
            self.low = engines


def engines_for_ttft(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    routers: Sequence[str],
    target_s: float,
    most: int,
    **common: Any,
) -> list[EnginesNeeded]:
    """For each of ``routers``, the fewest engines (1 to ``most``) whose TTFT p90 on
    ``trace`` is below ``target_s`` seconds; ``common``: every run's other arguments to
    :func:`composer.simulate.fleet.simulate_fleet` (arrivals, sizes, cost)."""
    check_target(target_s)
    most = check_engines(most, "--fleet")
    found = [EnginesNeeded(router, target_s, most) for router in routers]
    searches = [_Bisection(most) for _ in routers]
    while asks := [(i, n) for i, s in enumerate(searches) if (n := s.next()) is not None]:
        runs = [{"router": found[i].router, "engines": n} for i, n in asks]
        results = simulate_many(pipeline, trace, runs, **{**common, "engines": most})
        for (i, n), result in zip(asks, results, strict=True):
            found[i].runs[n] = result
            searches[i].record(n, _p90(result) < target_s)
    for answer, search in zip(found, searches, strict=True):
        answer.engines = search.high
    return found


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f}"


def format_engines_needed(found: Sequence[EnginesNeeded]) -> str:
    """Per policy: the engines needed, the TTFT p90 there and with one fewer, what was
    served there, and how many runs the search took."""
    header = ("router", "engines needed", "TTFT p90 ms", "with one fewer", "served", "runs")
    rows: list[tuple[str, ...]] = []
    for f in found:
        fewer = "-" if f.one_fewer is None else _ms(f.p90(f.one_fewer))
        if f.engines is None:
            needed, p90, served = f"more than {f.most}", "-", "-"
            fewer = f"{fewer} (at {f.most})"
        else:
            run = f.runs[f.engines]
            needed, p90 = str(f.engines), _ms(_p90(run))
            served = f"{100 * run.fraction_served:.1f}%"
        rows.append((f.router, needed, p90, fewer, served, str(len(f.runs))))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    first = next(iter(found[0].runs.values())) if found and found[0].runs else None
    lines = (
        [
            f"fewest engines (1 to {found[0].most}) for a TTFT p90 below "
            f"{_ms(found[0].target_s)} ms"
            + (f": {first.requests:,} requests, arrivals: {first.arrivals}" if first else "")
        ]
        if found
        else []
    )
    for cells in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    lines.append(
        "(by bisection, assuming the p90 falls as engines are added; each answer simulated "
        "with one fewer, which misses)"
    )
    return "\n".join(lines)


def plot_engines_needed(path: Path, found: Sequence[EnginesNeeded], trace: str) -> None:
    """The search's runs as a sweep's plot: the fraction served and TTFT p90 against the
    engine count, one line per policy, the target and each answer marked."""
    plt = _pyplot()
    fig, (served, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for f in found:
        counts = sorted(f.runs)
        line = served.plot(
            counts, [100 * f.runs[n].fraction_served for n in counts], marker="o", label=f.router
        )
        ttft.plot(
            counts,
            [1000 * _p90(f.runs[n]) for n in counts],
            marker="o",
            color=line[0].get_color(),
            label=f.router,
        )
        if f.engines is not None:
            ttft.plot(
                [f.engines],
                [1000 * _p90(f.runs[f.engines])],
                marker="*",
                markersize=14,
                color=line[0].get_color(),
            )
    target = found[0].target_s if found else 0.0
    ttft.axhline(1000 * target, linestyle="--", color="grey", label="target")
    counts = sorted({n for f in found for n in f.runs})
    for ax, label in ((served, "prompt tokens served (%)"), (ttft, "TTFT p90 (ms)")):
        if counts and counts[-1] > 8 * counts[0]:  # (a search halves: engines on a log scale)
            ax.set_xscale("log", base=2)
            ticks = [2**i for i in range(counts[-1].bit_length()) if 2**i >= counts[0]]
            ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("engines")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    served.set_ylim(0, 100)
    ttft.set_yscale("log")
    ttft.legend(fontsize="small")
    runs = [r for f in found for r in f.runs.values()]
    about = f" ({runs[0].requests:,} requests, {runs[0].arrivals})" if runs else ""
    fig.suptitle(f"kvc simulate --fleet {OPTION} {target:g}: {trace}{about}")
    _save(plt, fig, path)
