"""What a ``kvc bench`` run is asked to do (:class:`BenchSpec`), and the prompts it sends.

Both the one-server-per-configuration run (:mod:`.run`) and the fleet behind
vLLM's router (:mod:`.fleet`) take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from composer.bench.replay import BenchError, Prompt, make_prompts, vocab_size_of
from composer.bench.servers import Config, ServerSpec
from composer.trace import TraceRequest


@dataclass
class BenchSpec:
    trace: Sequence[TraceRequest]
    configs: Sequence[Config]
    server: ServerSpec | None
    url: str | None = None
    scale: int = 16
    concurrency: int | None = None
    speedup: float = 1.0
    max_output_tokens: int | None = None
    vocab_size: int | None = None
    workdir: Path = Path("kvc-bench")
    progress: bool = True
    #: Run the configurations this many times, in alternating order (ABCD, DCBA, ...),
    #: pooling each configuration's requests: a drifting machine load then favours none.
    rounds: int = 1
    #: Engines behind vLLM's router (``kvc bench --fleet``; 0: one server per configuration).
    fleet: int = 0
    #: The router's policies a fleet is run with (:data:`composer.bench.fleet.POLICIES`).
    policies: Sequence[str] = ()
    #: With ``concurrency``: seconds between a request's end and the next one's
    #: start, so that a router's load counts have settled (one request at a time
    #: is then one at a time to the router too).
    pause_s: float = 0.0
    #: With ``fleet``: passes of the prompts through the fleet (``round_robin``) before
    #: it is measured, its caches emptied after. An engine's first passes over a slice
    #: run slower (here its worker's CPU for one pass fell from 3.3 to 2.4 s over
    #: four), so the first policy measured pays for them.
    warm_up: int = 0
    #: A prefill and a decode engine behind the router's P/D mode, against the same
    #: engines without it (``kvc bench --pd``).
    pd: bool = False


def bench_prompts(spec: BenchSpec) -> tuple[list[Prompt], int]:
    """The trace's prompts, and how many of its requests do not fit --max-model-len."""
    vocab = spec.vocab_size
    if vocab is None and spec.server is not None:
        vocab = vocab_size_of(spec.server.model)
    if vocab is None:
        raise BenchError("--vocab-size is needed: the model's vocabulary size is not known")
    max_len = spec.server.max_model_len if spec.server is not None else None
    prompts, skipped = make_prompts(
        spec.trace,
        scale=spec.scale,
        vocab_size=vocab,
        max_output_tokens=spec.max_output_tokens,
        max_model_len=max_len,
    )
    if not prompts:
        raise BenchError("no request of the trace fits --max-model-len")
    return prompts, len(skipped)
