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
from collections.abc import Mapping
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

#: Measured on this project's machine (see the module's docstring); 2026-11-27.
CALIBRATED = CostModel(
    request_s=0.010,
    prefill_token_s=2.0e-5,
    load_token_s=2.0e-6,
    decode_token_s=0.004,
    speedup_4=2.0,
    speedup_8=2.5,
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


def cost_from(values: Mapping[str, float]) -> CostModel:
    """A cost model from a mapping (a calibration's JSON)."""
    return _checked(CostModel(**{f.name: float(values[f.name]) for f in fields(CostModel)}))
