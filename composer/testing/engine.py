"""Run real vLLM offline in a child process and report what it generated.

Each engine runs in its own process group with a hard timeout, so a hung
engine never stalls a test run, and with explicit CPU thread settings, so two
runs that are compared use the same number of OpenMP threads (tiny random
models have near-ties: a different thread count can flip a greedy token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from composer.servers import group_alive, spawn, stop_group

#: A prompt: text, or a dict: token ids as ``{"prompt_token_ids": [...]}`` (vLLM's
#: TokensPrompt) or text as ``{"prompt": "..."}``; a dict may add the request's
#: ``"kv_transfer_params"`` (its tier controls, say) and its ``"cache_salt"`` (tenant).
Prompt = str | dict[str, Any]


@dataclass
class EngineSpec:
    model: str
    rounds: Sequence[Sequence[Prompt]]
    kv_transfer_config: dict[str, Any] | None = None
    max_tokens: int = 8
    prefix_caching: bool = False
    #: Reset vLLM's own prefix cache between rounds, so a hit comes from the connector.
    reset_between_rounds: bool = True
    #: Reset only after these rounds (0-based), instead of after every round.
    reset_after: list[int] | None = None
    block_size: int = 32
    max_model_len: int = 2048
    kv_cache_gib: float = 1
    #: VLLM_CPU_OMP_THREADS_BIND, the same on both sides of any comparison.
    threads_bind: str = "0-1"
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 420
    #: Skip torch.compile and its warm-up (vLLM's ``enforce_eager``): an engine
    #: starts seconds sooner. Both sides of a token comparison must agree on it.
    enforce_eager: bool = False
    #: Run vLLM's engine core and its worker in the engine's own process
    #: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a mode vLLM supports), as tests do:
    #: no EngineCore and worker processes to spawn, each importing vLLM, so a tiny
    #: model's engine runs in about 8 s instead of 24 on a 2-core machine. The
    #: connector's metadata then reaches the worker as an object, not pickled;
    #: off (vLLM's default, and what ``kvc serve`` runs) where that crossing or
    #: timings matter.
    in_process: bool = False
    #: Publish vLLM's KV cache events over ZMQ here (``--kv-events-config``
    #: ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}``).
    kv_events_endpoint: str | None = None
    #: vLLM's ``dtype`` (``auto``: the model's own, bfloat16 for the tiny models).
    #: Engines that load NIXL run ``float32``: with bfloat16 a consumer engine died
    #: with ``Illegal instruction`` in ``cpu_attention_with_kv_cache`` once NIXL
    #: was loaded (not without it), on vLLM 0.32's CPU build.
    dtype: str = "auto"


@dataclass
class RequestResult:
    prompt_tokens: int
    tokens: list[int]
    cached_tokens: int
    ttft_s: float | None
    kv_transfer_params: dict[str, Any] | None


@dataclass
class EngineResult:
    rounds: list[list[RequestResult]]
    startup_s: float
    log_tail: str = ""
    #: The engine's whole log (stdout and stderr of every vLLM process).
    log: str = ""
    #: The engine and every process it started exited on their own (no signal sent).
    clean_exit: bool = True
    #: The engine's Prometheus metrics after its last round (text format, what a
    #: server's ``/metrics`` shows: KV Composer's per-node series included).
    metrics: str = ""

    def tokens(self, round_index: int) -> list[list[int]]:
        return [r.tokens for r in self.rounds[round_index]]


#: Seconds EngineCore gets to stop on its own before vLLM kills it.
SHUTDOWN_GRACE_S = 60.0


class EngineFailed(RuntimeError):
    #: As on EngineResult.
    log: str = ""
    clean_exit: bool = True


def plugin_env(folder: Path, *modules: str) -> dict[str, str]:
    """Environment for engines that load the plugin ``modules`` found in ``folder``.

    The engine's processes import them through ``$KV_COMPOSER_PLUGIN_MODULES``,
    as they would a user's plugin modules that have no entry point.
    """
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KV_COMPOSER_PLUGIN_MODULES": ",".join(modules)}


def run_engine(spec: EngineSpec) -> EngineResult:
    with tempfile.TemporaryDirectory(prefix="kvc-engine-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        out_file = Path(tmp) / "result.json"
        log_file = Path(tmp) / "engine.log"
        spec_file.write_text(json.dumps(asdict(spec)))
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": spec.threads_bind,
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if spec.in_process else "1",
            **spec.env,
        }
        argv = [sys.executable, "-m", "composer.testing.engine", str(spec_file), str(out_file)]
        proc = spawn(argv, log_file, env=env)
        try:
            proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            signalled = stop_engine(proc)
            _wait_reaped(proc.pid)
        text = log_file.read_text(errors="replace")
        tail = text[-6000:]
        if proc.returncode != 0 or not out_file.exists():
            # The root cause is usually the first error line, far above the tail.
            errors = [line for line in text.splitlines() if "Error" in line][:8]
            failure = EngineFailed(
                f"vLLM engine exited with {proc.returncode}; first errors:\n"
                + "\n".join(errors)
                + f"\n--- log tail ---\n{tail}"
            )
            failure.log = text
            failure.clean_exit = not signalled
            raise failure
        data = json.loads(out_file.read_text())
        return EngineResult(
            rounds=[[RequestResult(**r) for r in rnd] for rnd in data["rounds"]],
            startup_s=data["startup_s"],
            log_tail=tail,
            log=text,
            clean_exit=not signalled,
            metrics=data.get("metrics", ""),
        )


class SharedRuns:
    """One engine configuration's runs, shared by several test modules.

    Every round list declared up front (``wanted``) runs in one engine, one
    list after the other, on the first call; each caller gets the result of
    its own rounds, as if it had run them alone. For engines without state
    between rounds (no connector, vLLM's prefix cache off) that is what a run
    of its own would give: every round is the same batch of prompts, in an
    engine with the same settings. A round list not declared gets an engine of
    its own.
    """

    def __init__(self, spec: EngineSpec, wanted: Sequence[list[list[Prompt]]] = ()) -> None:
        if spec.reset_after is not None:
            raise ValueError("reset_after counts rounds of one list: not for shared runs")
        #: The settings; its rounds are ignored.
        self.spec = spec
        self._pending = [list(r) for r in wanted]
        self._done: list[tuple[list[list[Prompt]], EngineResult]] = []
        #: Engines started so far.
        self.engines = 0

    def __call__(self, rounds: list[list[Prompt]]) -> EngineResult:
        for known, result in self._done:
            if known == rounds:
                return result
        batch = [rounds, *(r for r in self._pending if r != rounds)]
        self._pending = []
        total = sum(len(r) for r in batch)
        spec = replace(
            self.spec,
            rounds=[rnd for r in batch for rnd in r],
            # A hang limit only: the spec's own, plus time for the added rounds.
            timeout_s=self.spec.timeout_s + 5 * (total - len(rounds)),
        )
        self.engines += 1
        whole = run_engine(spec)
        start = 0
        for r in batch:
            part = replace(whole, rounds=whole.rounds[start : start + len(r)])
            self._done.append((r, part))
            start += len(r)
        return self._done[-len(batch)][1]


#: Seconds to wait for the engine's exited processes to be reaped.
REAP_WAIT_S = 5.0


def _wait_reaped(pgid: int) -> None:
    """Wait a little for the group's zombies to be reaped, by init once their parent is
    gone: until then their pids still answer ``kill(pid, 0)``, so a caller checking
    that a process the engine started (e.g. a server) is gone would see it alive."""
    deadline = time.monotonic() + REAP_WAIT_S
    while group_alive(pgid, zombies=True) and time.monotonic() < deadline:
        time.sleep(0.1)


def stop_engine(
    proc: subprocess.Popen[Any], grace_s: float = SHUTDOWN_GRACE_S, signal_wait_s: float = 10
) -> bool:
    """Stop the engine and every process it spawned (EngineCore, workers); True
    if a signal was needed. An engine still running here is hung (past its
    timeout): its whole group gets the signals, not the leader first."""
    return stop_group(proc, grace_s, signal_wait=signal_wait_s, ask_leader=False)


def build_llm(spec: EngineSpec) -> Any:
    """vLLM's offline ``LLM`` for ``spec`` (in the process that runs the engine)."""
    from vllm import LLM

    kv_events = None
    if spec.kv_events_endpoint:
        from vllm.config import KVEventsConfig

        kv_events = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec.kv_events_endpoint
        )
    return LLM(
        model=spec.model,
        kv_events_config=kv_events,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        enable_prefix_caching=spec.prefix_caching,
        kv_transfer_config=spec.kv_transfer_config,
        enforce_eager=spec.enforce_eager,
        dtype=spec.dtype,  # type: ignore[arg-type]  # (checked by vLLM)
        disable_log_stats=False,
        seed=0,
    )


def generate(llm: Any, prompts: Sequence[Prompt], max_tokens: int) -> list[dict[str, Any]]:
    """One batch of greedy requests on ``llm``, as RequestResult fields."""
    from vllm import SamplingParams
    from vllm.inputs import TextPrompt, TokensPrompt

    def sampling(prompt: Prompt) -> SamplingParams:
        extra = None
        if isinstance(prompt, dict) and "kv_transfer_params" in prompt:
            # (how vLLM's offline API passes a request's kv_transfer_params)
            extra = {"kv_transfer_params": prompt["kv_transfer_params"]}
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra
        )

    def engine_input(prompt: Prompt) -> Any:
        if isinstance(prompt, str):
            return prompt
        one: TextPrompt | TokensPrompt = (
            TokensPrompt(prompt_token_ids=prompt["prompt_token_ids"])
            if "prompt_token_ids" in prompt
            else TextPrompt(prompt=prompt["prompt"])
        )
        if "cache_salt" in prompt:
            one["cache_salt"] = prompt["cache_salt"]
        return one

    inputs = [engine_input(p) for p in prompts]
    outputs = llm.generate(inputs, [sampling(p) for p in prompts], use_tqdm=False)
    return [
        {
            "prompt_tokens": len(o.prompt_token_ids or ()),
            "tokens": list(o.outputs[0].token_ids),
            "cached_tokens": o.num_cached_tokens or 0,
            "ttft_s": getattr(o.metrics, "first_token_latency", None) or None,
            "kv_transfer_params": o.kv_transfer_params,
        }
        for o in outputs
    ]


def _child(spec_path: str, out_path: str) -> None:

    spec = EngineSpec(**json.loads(Path(spec_path).read_text()))
    t0 = time.perf_counter()
    llm = build_llm(spec)
    startup = time.perf_counter() - t0
    rounds = []
    for index, prompts in enumerate(spec.rounds):
        rounds.append(generate(llm, prompts, spec.max_tokens))
        if spec.reset_after is not None:
            reset = index in spec.reset_after
        else:
            reset = spec.reset_between_rounds
        if reset and spec.prefix_caching:
            llm.reset_prefix_cache()
    from prometheus_client import REGISTRY, generate_latest

    metrics = generate_latest(REGISTRY).decode()
    Path(out_path).write_text(
        json.dumps({"rounds": rounds, "startup_s": startup, "metrics": metrics})
    )
    # Shut the engine down the way vLLM does, so connectors see their shutdown
    # calls, before this process exits. vLLM's default grace of 5 s before it
    # kills EngineCore is too short on a busy 2-core machine: a killed EngineCore
    # leaves its executor's shared-memory queues behind in /dev/shm.
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
    # vLLM's engine processes are torn down with ours; don't wait on atexit hooks.
    os._exit(0)
