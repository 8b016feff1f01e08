"""How long an engine takes over a request, in ``kvc simulate --fleet``'s model of time.

A request's work on an engine is its prefill (a fixed part, each prompt token
computed, each token loaded from a node; vLLM's own prefix-cache hits cost
nothing) and then its decode (each output token after the first, which the
prefill step samples). An engine serves its requests in flight side by side
(vLLM's continuous batching), sharing its speed: with ``n`` in flight it does
``batch_speedup(n)`` times the work of one request alone per second, each of
the ``n`` getting an equal part (processor sharing). A request's TTFT is when
its prefill work is done, its end when all of it is.

:data:`CALIBRATED` are the figures measured on this project's 2-core machine
(``kvc bench``, the tiny model, one engine on one core, lengths scaled by 16;
see docs/simulate.md): on another model or machine, give your own with
``--cost NAME=VALUE,...``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from composer.simulate.tiers import SimulateError


@dataclass(frozen=True)
class CostModel:
    #: Seconds a request takes whatever its length (scheduling, the HTTP round trip).
    request_s: float
    #: Seconds per prompt token the engine computes.
    prefill_token_s: float
    #: Seconds per prompt token loaded from a node (vLLM's own prefix cache: none).
    load_token_s: float
    #: Seconds per output token after the first.
    decode_token_s: float
    #: Work done per second with 4 and with 8 requests in flight, over with one
    #: (1 and 1: no gain from batching); between and beyond, linear and then flat.
    speedup_4: float = 1.0
    speedup_8: float = 1.0

    def prefill_s(self, computed: int, loaded: int) -> float:
        return self.request_s + self.prefill_token_s * computed + self.load_token_s * loaded

    def decode_s(self, output_tokens: int) -> float:
        return self.decode_token_s * max(0, output_tokens - 1)

    def batch_speedup(self, in_flight: int) -> float:
        """Work per second with ``in_flight`` requests, over one request alone."""
        xs, ys = _POINTS, (1.0, self.speedup_4, self.speedup_8)
        if in_flight <= 1:
            return 1.0
        if in_flight >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, in_flight) - 1
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return y0 + (y1 - y0) * (in_flight - x0) / (x1 - x0)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_POINTS = (1, 4, 8)

#: Fitted by ``benchmarks/cost_model.py`` on this project's machine, 2026-11-28 (one
#: engine, the tiny model, every process of it on one core; 110 requests of the
#: Mooncake conversation trace, lengths / 16, 16 output tokens): TTFT p50 / p90
#: measured 12 / 35 ms alone, 65 / 121 ms at 4 in flight, 186 / 248 ms at 8; this
#: model gives 13 / 33, 33 / 82 and 63 / 160 (docs/simulate.md says why).
CALIBRATED = CostModel(
    request_s=0.0060,
    prefill_token_s=2.16e-5,
    load_token_s=4.07e-6,
    decode_token_s=0.00267,
    speedup_4=1.61,
    speedup_8=1.70,
)


def parse_cost(text: str, base: CostModel = CALIBRATED) -> CostModel:
    """``NAME=VALUE,...`` over ``base`` (``--cost``); every name a field, every value >= 0."""
    names = {f.name for f in fields(CostModel)}
    changes: dict[str, float] = {}
    for item in (i.strip() for i in text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise SimulateError(
                f"--cost: expected NAME=SECONDS,... with NAME one of {', '.join(sorted(names))}, "
                f"got {item!r}"
            )
        try:
            number = float(value)
        except ValueError:
            raise SimulateError(f"--cost {name}: not a number: {value!r}") from None
        if not number >= 0 or number == float("inf"):
            raise SimulateError(f"--cost {name}: must be a finite number >= 0, got {value!r}")
        changes[name] = number
    return _checked(replace(base, **changes))


def _checked(model: CostModel) -> CostModel:
    if model.speedup_4 <= 0 or model.speedup_8 <= 0:
        raise SimulateError("--cost: speedup_4 and speedup_8 must be > 0")
    return model


@dataclass(frozen=True)
class Sample:
    """One measured request: prompt tokens computed and loaded, output tokens, its times."""

    computed: int
    loaded: int
    output: int
    ttft_s: float
    e2e_s: float


def fit(alone: Sequence[Sample], in_flight: Mapping[int, tuple[Sequence[Sample], float]],
        wall_alone_s: float) -> CostModel:
    """The cost model of requests measured one at a time (``alone``: no wait, so a TTFT
    is the prefill's time and the rest the decode's), and its batching gain at 4 and 8
    in flight (``in_flight[n]``: that run's samples and wall seconds): the work done
    per second there over the work done per second alone."""
    ttft = _least_squares(
        [(1.0, float(s.computed), float(s.loaded)) for s in alone], [s.ttft_s for s in alone]
    )
    steps = sum(max(0, s.output - 1) for s in alone)
    decode = sum(s.e2e_s - s.ttft_s for s in alone) / steps if steps else 0.0
    model = CostModel(ttft[0], ttft[1], ttft[2], max(0.0, decode))

    def rate(samples: Sequence[Sample], wall: float) -> float:
        work = sum(model.prefill_s(s.computed, s.loaded) + model.decode_s(s.output)
                   for s in samples)
        return work / wall if wall > 0 else 0.0

    base = rate(alone, wall_alone_s)
    gains = {n: rate(*in_flight[n]) / base if base else 1.0 for n in in_flight}
    return _checked(replace(model, speedup_4=gains.get(4, 1.0), speedup_8=gains.get(8, 1.0)))


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
    return [0.0] * (len(rows[0]) if rows else 0)


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
