"""``kvc calibrate``: the engine model's costs (:class:`~.cost.CostModel`) fitted to
``kvc bench`` runs of one engine at several concurrencies, and checked against them.

A run one request at a time gives what a step costs alone: least squares over
its TTFTs give the request's way in plus a step (``request_s + step_s``), the
seconds per prompt token computed and per token loaded; its decode gives a
step with one request decoding (``step_s + decode_seq_s``). How those two sums
split shows only with several in flight (a step shared by many decodes costs
``step_s`` once): the split is the one whose simulated runs (:mod:`.steps`,
the same requests sent as ``kvc bench --concurrency N`` sends them) come
closest to the measured TTFT p50 and p90 and wall time, tried on a grid. The
engine's limits (its token budget, running requests, KV cache blocks) are
vLLM's settings of the measured engine, given, not fitted.

A calibration file holds the fitted costs, the format's version and what the
fit was checked against; ``kvc simulate --calibration FILE`` reads it back.

What engines sharing a host add to one alone (an idle engine's wake-up, the
cores they share with the router and the clients) is fitted on a fleet's
``round_robin`` runs, over the engine's costs (:func:`fit_fleet`; ``kvc
simulate --fit-fleet``).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from composer.simulate.cost import CostModel, cost_from
from composer.simulate.steps import Job, StepEngine
from composer.simulate.tiers import SimKVGroup, SimulateError

#: The calibration file's format; a file of another is refused (its fields may differ).
FORMAT = 2
#: The splits of a step's cost tried (the share of one decode step that is ``step_s``).
GRID = 40
#: What :func:`fit_to_rate` fits on a fleet's run, each between these, in halvings.
FLEET_FIELDS = {"shared_step_factor": (1.0, 8.0), "wake_s": (0.0, 0.1)}
HALVINGS = 16


@dataclass(frozen=True)
class Sample:
    """One measured request: prompt tokens computed and loaded, output tokens, its times."""

    computed: int
    loaded: int
    output: int
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True)
class Served:
    """A run, measured or simulated: its TTFTs, end-to-end times and wall time."""

    ttft_s: list[float]
    e2e_s: list[float]
    wall_s: float

    def ttft(self, q: int) -> float:
        return percentile(self.ttft_s, q)

    @property
    def requests_per_s(self) -> float:
        return len(self.e2e_s) / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: Sequence[float], q: int) -> float:
    """Nearest rank, as ``kvc bench`` reports its percentiles."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def serve(
    samples: Sequence[Sample],
    concurrency: int,
    cost: CostModel,
    block_size: int,
    groups: Sequence[SimKVGroup] = (),
) -> Served:
    """``samples`` sent as ``kvc bench --concurrency`` sends them (each client sends the
    next request when its last one ends) to one engine of ``cost`` (its model's KV cache
    ``groups``; none: one full-attention group)."""
    engine = StepEngine(cost, block_size, groups)
    jobs = [
        Job(i, 0.0, s.computed + s.loaded, s.loaded, s.loaded, s.output)
        for i, s in enumerate(samples)
    ]
    #: (when it reaches the engine's queue, order, the request)
    coming: list[tuple[float, int, Job]] = []
    sent = 0

    #: The router's CPU taken from a shared core, so far and at the last step's start.
    router_cpu = router_cpu_seen = 0.0

    def send(now: float) -> None:
        nonlocal sent, router_cpu
        if sent < len(jobs):
            busy = int(sent > len(e2es))  # (requests in flight: the engine holds its core)
            if cost.fills(busy):
                router_cpu += cost.router_cpu_s
            jobs[sent].arrival = now
            heapq.heappush(coming, (now + cost.way_in(busy), sent, jobs[sent]))
            sent += 1

    ttfts: list[float] = []
    e2es: list[float] = []
    for _ in range(concurrency):
        send(0.0)
    now, step_end, idle_since = 0.0, math.inf, 0.0
    while coming or engine.busy or engine.waiting or engine.running:
        if engine.busy and (not coming or step_end <= coming[0][0]):
            now = step_end
            first, done = engine.end_step()
            ttfts += [now - j.arrival for j in first]
            e2es += [now - job.arrival for job in done]
            for _ in done:
                send(now)
        elif coming:
            when, _, job = heapq.heappop(coming)
            now = max(now, when)
            engine.add(job)
            if coming and coming[0][0] <= now:
                continue  # (requests arriving together are scheduled together)
        if not engine.busy:
            took = engine.start_step()
            step_end = math.inf
            if took is not None:
                # (As a fleet's engine steps: :mod:`.fleet`'s ``_start_step``.)
                took = cost.shared_step(took, 1, router_cpu - router_cpu_seen)
                router_cpu_seen = router_cpu
                step_end = idle_since = now + took + cost.woken(now - idle_since)
    return Served(ttfts, e2es, now)


def fit(
    runs: Mapping[int, Sequence[Sample]],
    walls: Mapping[int, float],
    limits: CostModel,
    block_size: int,
    groups: Sequence[SimKVGroup] = (),
) -> CostModel:
    """The costs of ``runs`` (concurrency -> its samples, 1 among them; ``walls``: each
    run's wall seconds) with ``limits``' vLLM limits."""
    if 1 not in runs or not runs[1]:
        raise SimulateError("calibrate: a run with one request in flight is needed")
    alone = [s for s in runs[1] if s.computed <= limits.max_num_batched_tokens]
    if len(alone) < 3:
        raise SimulateError(
            f"calibrate: the run with one request in flight has {len(alone)} request(s) whose "
            f"prompt fits one step (max_num_batched_tokens {limits.max_num_batched_tokens}); "
            "at least 3 are needed"
        )
    intercept, per_token, per_loaded = _least_squares(
        [(1.0, float(s.computed), float(s.loaded)) for s in alone], [s.ttft_s for s in alone]
    )
    steps = sum(max(0, s.output - 1) for s in runs[1])
    decode = max(0.0, sum(s.e2e_s - s.ttft_s for s in runs[1]) / steps) if steps else 0.0
    top = min(intercept, decode)
    best: tuple[float, CostModel] | None = None
    for i in range(GRID + 1):
        step = top * i / GRID
        model = replace(
            limits,
            request_s=intercept - step,
            step_s=step,
            prefill_token_s=per_token,
            load_token_s=per_loaded,
            decode_seq_s=decode - step,
        )
        error = sum(
            _error(measured(samples, walls[n]), serve(samples, n, model, block_size, groups))
            for n, samples in runs.items()
            if n > 1
        )
        if best is None or error < best[0]:
            best = (error, model)
    assert best is not None
    return best[1]


def measured(samples: Sequence[Sample], wall_s: float) -> Served:
    return Served([s.ttft_s for s in samples], [s.e2e_s for s in samples], wall_s)


def _error(real: Served, sim: Served) -> float:
    """Relative errors of TTFT p50, p90 and the wall time, summed."""
    pairs = (
        (real.ttft(50), sim.ttft(50)),
        (real.ttft(90), sim.ttft(90)),
        (real.wall_s, sim.wall_s),
    )
    return sum(abs(s - r) / r for r, s in pairs if r > 0)


def _least_squares(rows: Sequence[tuple[float, ...]], ys: Sequence[float]) -> list[float]:
    """Coefficients >= 0 minimising the squared error of ``rows . c`` against ``ys``: the
    normal equations solved, a coefficient that comes out negative dropped (0) and the
    rest solved again. (Three unknowns: no numpy needed.)"""
    free = list(range(len(rows[0]))) if rows else []
    while free:
        a = [[sum(r[i] * r[j] for r in rows) for j in free] for i in free]
        b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in free]
        solved = _solve(a, b)
        if solved is not None and all(c >= 0 for c in solved):
            out = [0.0] * len(rows[0])
            for i, c in zip(free, solved, strict=True):
                out[i] = c
            return out
        # Singular (a column all zeros) or negative: drop the last such term.
        bad = [i for i, c in zip(free, solved or [-1.0] * len(free), strict=True) if c < 0]
        free.remove(bad[-1])
    return [0.0] * (len(rows[0]) if rows else 3)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def write_calibration(path: Path, cost: CostModel, checked: Mapping[str, Any]) -> None:
    """The calibration file: the format, the fitted costs, what they were checked against."""
    data = {"format": FORMAT, "cost": cost.as_dict(), "checked": checked}
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_calibration(path: Path) -> CostModel:
    """A calibration file's costs; a located error for anything else."""
    data = _json(path, "a calibration file")
    if not isinstance(data, dict) or "format" not in data:
        raise SimulateError(f"{path}: not a calibration file (no format; kvc calibrate writes one)")
    if data["format"] != FORMAT:
        raise SimulateError(
            f"{path}: format: a calibration file of format {data['format']!r}, this kvc reads "
            f"format {FORMAT}; calibrate again with this version (kvc calibrate)"
        )
    if not isinstance(data.get("cost"), dict):
        raise SimulateError(f"{path}: cost: expected a mapping of the costs")
    return cost_from(data["cost"], f"{path}: cost")


def fit_to_rate(
    cost: CostModel,
    name: str,
    measured_rate: float,
    rate: Callable[[CostModel], float],
    **changes: Any,
) -> CostModel:
    """``cost`` (with ``changes``) and its field ``name`` (one of :data:`FLEET_FIELDS`)
    at which a fleet's run, simulated (``rate``: its requests per second under a cost
    model), serves the ``measured_rate`` that fleet served: its least where the
    simulated fleet is no faster, at most its largest. The engine's own costs come
    first: fitted on one engine alone (:func:`fit`), where nothing contends for it."""
    if name not in FLEET_FIELDS:
        raise ValueError(f"{name}: not one of {', '.join(FLEET_FIELDS)}")
    if not measured_rate > 0:
        raise SimulateError(f"calibrate: {name} needs a measured rate > 0")
    low, high = FLEET_FIELDS[name]

    def at(value: float) -> CostModel:
        fields: dict[str, Any] = {**changes, name: value}
        return replace(cost, **fields)

    if rate(at(low)) <= measured_rate:
        return at(low)
    for _ in range(HALVINGS):
        middle = (low + high) / 2
        if rate(at(middle)) > measured_rate:
            low = middle
        else:
            high = middle
    return at(float(f"{(low + high) / 2:.3g}"))


@dataclass(frozen=True)
class FleetRun:
    """A fleet's ``round_robin`` run as ``kvc bench --fleet`` measured it: the requests a
    second it served and the router's CPU seconds a request (0: not read)."""

    requests_per_s: float
    router_cpu_s: float = 0.0


def fit_fleet(
    cost: CostModel,
    runs: Mapping[int, FleetRun],
    rate: Callable[[int, CostModel], float],
    host_cores: int,
) -> CostModel:
    """``cost`` with what a fleet adds to its engines alone, fitted on its ``round_robin``
    runs (``runs``: by requests in flight; ``rate``: the simulated fleet's requests a
    second at that many in flight under a cost model): ``wake_s`` on the run one at a
    time (each request finds its engine idle since the one before the last), then, on
    ``host_cores`` shared cores (0: none, nothing more to fit), ``shared_step_factor``
    on the run with the most in flight, besides the router's CPU as measured there."""
    if 1 in runs:
        cost = fit_to_rate(cost, "wake_s", runs[1].requests_per_s, lambda c: rate(1, c))
    most = max((n for n in runs if n > 1), default=None)
    if most is None or host_cores < 1:
        return cost
    return fit_to_rate(
        cost,
        "shared_step_factor",
        runs[most].requests_per_s,
        lambda c: rate(most, c),
        host_cores=host_cores,
        router_cpu_s=runs[most].router_cpu_s,
    )


def read_fleet_bench(paths: Sequence[Path]) -> dict[int, FleetRun]:
    """The ``round_robin`` runs in ``kvc bench --fleet``'s ``bench.json`` files, by
    requests in flight; a located error for anything else."""
    runs: dict[int, FleetRun] = {}
    for path in paths:
        data = _json(path, "kvc bench --fleet's bench.json")
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise SimulateError(f"{path}: not kvc bench's bench.json (a list of runs)")
        for i, run in enumerate(data):
            if run.get("config") != "round_robin":
                continue
            where = f"{path}: run {i} (round_robin)"
            n, rate, cpu = (
                run.get(k) for k in ("concurrency", "requests_per_s", "router_cpu_ms_per_request")
            )
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise SimulateError(
                    f"{where}: concurrency: expected kvc bench --fleet --concurrency N's, got {n!r}"
                )
            if n in runs:
                raise SimulateError(f"{where}: a second round_robin run at concurrency {n}")
            if not (_finite(rate) and rate > 0):
                raise SimulateError(f"{where}: requests_per_s: expected a number > 0, got {rate!r}")
            if cpu is not None and not (_finite(cpu) and cpu >= 0):
                raise SimulateError(
                    f"{where}: router_cpu_ms_per_request: expected a number >= 0, got {cpu!r}"
                )
            runs[n] = FleetRun(float(rate), (cpu or 0.0) / 1000)
    if not runs:
        raise SimulateError(
            f"{', '.join(map(str, paths))}: no round_robin run (kvc bench --fleet N "
            "--policy round_robin --concurrency 1, and again with more in flight)"
        )
    return runs


def _finite(value: Any) -> bool:
    """A finite number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def samples_of(records: Sequence[Mapping[str, Any]]) -> list[Sample]:
    """``kvc bench``'s records (``bench.json``) that finished, as samples (a cached token
    is one a node loaded: calibrate with vLLM's prefix cache off)."""
    return [
        Sample(
            r["prompt_tokens"] - (r.get("cached_tokens") or 0),
            r.get("cached_tokens") or 0,
            r["output_tokens"],
            r["ttft_s"],
            r["e2e_s"],
        )
        for r in records
        if r.get("error") is None and r.get("ttft_s") is not None and r.get("e2e_s") is not None
    ]


def read_bench(paths: Sequence[Path]) -> tuple[dict[int, list[Sample]], dict[int, float]]:
    """The runs of ``kvc bench --concurrency N`` in ``bench.json`` files, by concurrency:
    their samples and wall seconds; a located error for anything else."""
    runs: dict[int, list[Sample]] = {}
    walls: dict[int, float] = {}
    for path in paths:
        data = _json(path, "kvc bench's bench.json")
        if not isinstance(data, list):
            raise SimulateError(f"{path}: not kvc bench's bench.json (a list of runs)")
        for i, run in enumerate(data):
            where = f"{path}: run {i}"
            n = run.get("concurrency") if isinstance(run, dict) else None
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise SimulateError(
                    f"{where}: concurrency: expected a run of kvc bench --concurrency N, got {n!r}"
                )
            if n in runs:
                raise SimulateError(f"{where}: a second run at concurrency {n}")
            try:
                runs[n], walls[n] = samples_of(run["records"]), float(run["wall_s"])
            except (KeyError, TypeError, ValueError) as exc:
                raise SimulateError(f"{where}: records: not kvc bench's ({exc!r})") from None
    return runs, walls


def _json(path: Path, what: str) -> Any:
    """``path``'s JSON; a located error when it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise SimulateError(f"{path}: cannot read {what}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SimulateError(f"{path}: not {what} (JSON): {exc}") from None
