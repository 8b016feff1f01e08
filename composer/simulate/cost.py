"""What an engine's work costs, in ``kvc simulate --fleet``'s engine model (:mod:`.steps`).

An engine runs in steps, as vLLM's scheduler runs it: each step takes a fixed
time, plus a time per prompt token it computes, per token a node loads into
it and per request decoding in it; a request takes ``request_s`` to reach the
engine's queue (the HTTP round trip, the API server). What a step may hold is
vLLM's own limits: its token budget, its running requests, its KV cache.

Engines that share a host's CPU cores with each other, the router and the
clients (vLLM's CPU build, several engines on one machine) run slower when
they are all busy: ``host_cores`` says how many cores they share (0: each
engine has its own, and the router and clients theirs: a GPU fleet) and
``shared_step_factor`` how much longer a step, and a request's way in, take
while at least that many engines have requests. An engine that sat idle
(longer than a request's way in) takes ``wake_s`` more to start its next
step: its processes are woken. Both are fitted on a fleet's runs
(:func:`.calibrate.fit_fleet`). The router's own CPU a request
(``router_cpu_s``, measured: ``kvc bench --fleet`` prints it per policy;
vllm-router's ``kv_aware`` reads every engine's KV events and takes twice the
others') is taken from the engines' steps while they fill the shared cores,
spread over those cores.

:data:`CALIBRATED` are the figures measured on this project's 2-core machine
(``kvc bench``, the tiny model, one engine on one core, lengths scaled by 16;
see docs/simulate.md and :mod:`.calibrate`): on another model or machine,
calibrate there (``kvc calibrate``) or give your own with ``--cost NAME=VALUE,...``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from composer.simulate.tiers import SimulateError


@dataclass(frozen=True)
class CostModel:
    #: Seconds from a client's send to the engine's queue (HTTP, the API server).
    request_s: float
    #: Seconds each engine step takes whatever it runs.
    step_s: float
    #: Seconds per prompt token a step computes.
    prefill_token_s: float
    #: Seconds per prompt token a node loads (in the step that first schedules it).
    load_token_s: float
    #: Seconds per request decoding (one token) in a step.
    decode_seq_s: float
    #: vLLM's limits: a step's token budget (``--max-num-batched-tokens``; 2048 on its
    #: CPU build's API server), its running requests (``--max-num-seqs``; 128 there)
    #: and its KV cache in blocks (``--num-gpu-blocks-override``; 0: what the
    #: requests need).
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    num_gpu_blocks: int = 0
    #: The CPU cores the engines share with each other, the router and the clients
    #: (0: none shared), and the factor on a step's time and a request's way in while
    #: that many engines have requests (their steps, the router's and the clients'
    #: work contend).
    host_cores: int = 0
    shared_step_factor: float = 1.0
    #: Seconds more for the first step of an engine idle for longer than ``request_s``.
    wake_s: float = 0.0
    #: The router's CPU seconds a request: on shared cores, taken from the engines'
    #: steps while they fill them.
    router_cpu_s: float = 0.0

    def alone_ttft_s(self, computed: int, loaded: int) -> float:
        """A request's TTFT on an engine with nothing else to do."""
        chunks = max(1, -(-computed // self.max_num_batched_tokens))
        return (
            self.request_s
            + self.step_s * chunks
            + self.prefill_token_s * computed
            + self.load_token_s * loaded
        )

    def woken(self, idle_s: float) -> float:
        """Seconds more for a step of an engine idle ``idle_s`` before it: ``wake_s`` when
        longer than a request's way in. (A client's next request to the same engine
        comes exactly that long after its last step; the nanosecond absorbs float
        rounding of those sums.)"""
        return self.wake_s if idle_s > self.request_s + 1e-9 else 0.0

    def fills(self, busy: int) -> bool:
        """Whether ``busy`` engines with requests fill the cores they share (none are
        shared: never)."""
        return 0 < self.host_cores <= busy

    def shared_step(self, took: float, busy: int, router_cpu: float) -> float:
        """A step of ``took`` seconds alone, with ``busy`` engines having requests, the
        router having spent ``router_cpu`` seconds on the shared cores since the
        engine's last step began: while the engines fill the cores, slower by the
        factor and by the router's CPU spread over the cores (each engine loses its
        core's part)."""
        if not self.fills(busy):
            return took
        return took * self.shared_step_factor + router_cpu / self.host_cores

    def way_in(self, busy: int) -> float:
        """Seconds from a client's send to the engine's queue while ``busy`` engines have
        requests: ``request_s``, slower by the factor while they fill the shared cores
        (the hops through the router and the API server wait for a core)."""
        return self.request_s * (self.shared_step_factor if self.fills(busy) else 1.0)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: The limits: whole numbers, each at least this.
LIMITS = {"max_num_batched_tokens": 1, "max_num_seqs": 1, "num_gpu_blocks": 0, "host_cores": 0}
#: Factors: finite numbers, each at least this.
FACTORS = {"shared_step_factor": 1.0}
#: Fields a calibration file may leave out (written before they existed): their defaults.
OPTIONAL = {"host_cores", "shared_step_factor", "wake_s", "router_cpu_s"}

#: Fitted by ``kvc calibrate`` on ``benchmarks/cost_model.py``'s runs on this project's
#: machine, 2026-11-28 (one engine, the tiny model, every process of it on one core,
#: its KV cache 80 blocks of 32 tokens; the Mooncake conversation slice, lengths / 16,
#: 16 output tokens; 1, 4 and 8 in flight). docs/simulate.md has the fit's table.
CALIBRATED = CostModel(
    request_s=0.0038,
    step_s=0.00149,
    prefill_token_s=1.38e-5,
    load_token_s=3.63e-6,
    decode_seq_s=0.00037,
)


def parse_cost(text: str, base: CostModel = CALIBRATED) -> CostModel:
    """``NAME=VALUE,...`` over ``base`` (``--cost``): seconds >= 0, limits whole numbers."""
    names = {f.name for f in fields(CostModel)}
    changes: dict[str, Any] = {}
    for item in (i.strip() for i in text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise SimulateError(
                f"--cost: expected NAME=VALUE,... with NAME one of {', '.join(sorted(names))}, "
                f"got {item!r}"
            )
        changes[name] = _value(f"--cost {name}", name, value)
    return replace(base, **changes)


def _value(where: str, name: str, value: Any) -> Any:
    """A field's value: seconds a finite number >= 0, a limit a whole number >= its least,
    a factor a finite number >= its least."""
    if name in LIMITS:
        try:
            number = int(str(value).strip())
        except ValueError:
            raise SimulateError(f"{where}: expected a whole number, got {value!r}") from None
        if number < LIMITS[name]:
            raise SimulateError(f"{where}: must be >= {LIMITS[name]}, got {value!r}")
        return number
    least = FACTORS.get(name, 0)  # (seconds: >= 0)
    try:
        real = float(value)
    except (TypeError, ValueError):
        raise SimulateError(f"{where}: not a number: {value!r}") from None
    if not least <= real < float("inf") or isinstance(value, bool):
        raise SimulateError(f"{where}: must be a finite number >= {least}, got {value!r}")
    return real


def cost_from(data: Mapping[str, Any], where: str) -> CostModel:
    """A cost model from its fields (a calibration file's ``cost``), every field checked."""
    names = [f.name for f in fields(CostModel)]
    missing = [n for n in names if n not in data and n not in OPTIONAL]
    unknown = sorted(set(data) - set(names))
    if missing or unknown:
        raise SimulateError(
            f"{where}: expected the fields {', '.join(names)}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {', '.join(unknown)}" if unknown else "")
        )
    return CostModel(**{n: _value(f"{where}.{n}", n, data[n]) for n in names if n in data})
