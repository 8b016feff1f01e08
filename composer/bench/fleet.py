"""``kvc bench --fleet N``: N engines behind vLLM's router, the trace once per routing policy.

N ``kvc serve`` engines run one pipeline, each with vLLM's KV event publisher
on (``--kv-events-config``, ZMQ), each on its own CPU core: every process of
it (API server, engine core, worker: ``taskset``), not only vLLM's compute
threads. (Bound by its threads alone, an engine's API server and engine core
went where the kernel put them, unevenly: with four in flight the router's
load terms then sent 109/42 and 119/32 of 151 requests to one engine where the
model of equal engines said 77/74; with every process bound, 80/71.) For each
policy the engines' caches are emptied (vLLM's ``/reset_prefix_cache`` with
``reset_external``: its prefix cache and every node's tier; vLLM says success
only once nothing was held, else it is asked again), vLLM's router
(:mod:`composer.servers.vllm_router`) is started in front with that policy,
the trace's prompts are replayed through it, and every engine's counters are
read around the replay. ``rounds`` repeats the policies in
alternating order and pools each one's requests.

The policies are the router's: ``round_robin``, ``consistent_hash``,
``cache_aware`` (the router's own guess of each engine's cache, from the
requests it routed), and ``kv_aware`` twice: ``kv_aware-vllm`` credits only
what vLLM's own events say (blocks in the engines' GPU prefix caches; the
router's credit for every other medium set to 0: the tiers invisible), and
``kv_aware-tiers`` credits the tiers' events too, at the router's default
rates (vllm-router 0.1.17: host 0.8, external 0.6, disk 0.3; KV Composer's
events name their node in ``ownership``, as vLLM's secondary tiers do, so the
router counts them as external).

vLLM's publisher binds only a wildcard or ``ipc://`` endpoint and the router
connects only to ``tcp://HOST:PORT``: each engine's publisher listens on
``tcp://*:PORT`` (a free port) and the router subscribes on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from composer import scrape
from composer.bench.replay import BenchError, Prompt, Record, replay, served_model
from composer.bench.report import RunResult, engine_counters, pool
from composer.bench.servers import Config, PortTaken, ServerSpec, servers
from composer.bench.spec import BenchSpec, bench_prompts
from composer.servers import cpu_seconds
from composer.servers.loopback import LOOPBACK, free_port
from composer.servers.vllm_router import vllm_router
from composer.simulate.routers import parse_router
from composer.simulate.tiers import SimulateError

#: Seconds after a replay for the engines' last counters to arrive.
SETTLE_S = 1.0
#: The router's credit for a cached block that is not in an engine's GPU cache.
NO_TIER_CREDIT = ("--kv-penalty-host", "0", "--kv-penalty-external", "0", "--kv-penalty-disk", "0")


@dataclass(frozen=True)
class Policy:
    name: str
    #: The router's arguments for it.
    args: tuple[str, ...]
    #: Whether the router subscribes to the engines' KV events.
    kv_events: bool = False


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("round_robin", ("--policy", "round_robin")),
        Policy("consistent_hash", ("--policy", "consistent_hash")),
        Policy("cache_aware", ("--policy", "cache_aware")),
        Policy("kv_aware-vllm", ("--policy", "kv_aware", *NO_TIER_CREDIT), kv_events=True),
        Policy("kv_aware-tiers", ("--policy", "kv_aware"), kv_events=True),
    )
}


@dataclass(frozen=True)
class Engine:
    url: str
    #: Where the router subscribes to its KV events.
    events: str
    #: Where the router asks for the events it missed (vLLM's replay socket).
    replay: str
    #: The server's process (its group holds every process of the engine).
    pid: int = 0


def policy(name: str) -> Policy:
    """One of :data:`POLICIES`, or a ``kv_aware`` one with vllm-router's settings after a
    colon (``kv_aware-tiers:external=0.8,affinity=300``, as ``kvc simulate --router``
    takes them: :func:`composer.simulate.routers.parse_router`)."""
    if name in POLICIES:
        return POLICIES[name]
    if ":" not in name:
        raise BenchError(f"--policy {name!r}: one of {', '.join(POLICIES)}")
    try:
        spec = parse_router(name, "--policy")
    except SimulateError as exc:
        raise BenchError(str(exc)) from None
    base = POLICIES[spec.policy]
    return Policy(name, (*base.args, *spec.router_args()), base.kv_events)


def run_fleet(spec: BenchSpec) -> list[RunResult]:
    """Every policy on one fleet (started once, emptied before each policy)."""
    policies = [policy(name) for name in spec.policies or POLICIES]
    config, server = own_engines(spec, "--fleet", "every engine")
    prompts, skipped = bench_prompts(spec)
    spec.workdir.mkdir(parents=True, exist_ok=True)
    pooled: dict[str, RunResult] = {}
    with fleet(config, server, spec.fleet, spec.workdir) as engines:
        warm_up(spec, engines, prompts)
        for round_index in range(spec.rounds):
            order = policies if round_index % 2 == 0 else policies[::-1]
            for p in order:
                log = spec.workdir / f"router-{p.name}-{round_index + 1}.log"
                result = run_policy(spec, engines, p, prompts, log)
                result.skipped = skipped
                pooled[p.name] = pool(pooled[p.name], result) if p.name in pooled else result
    return [pooled[p.name] for p in policies]


def warm_up(spec: BenchSpec, engines: Sequence[Engine], prompts: Sequence[Prompt]) -> None:
    """``spec.warm_up`` passes of the prompts through ``round_robin`` over the engines,
    not measured (every policy's run empties the caches first)."""
    for n in range(1, spec.warm_up + 1):
        log = spec.workdir / f"router-warm-up-{n}.log"
        run_policy(spec, engines, POLICIES["round_robin"], prompts, log)


def own_engines(spec: BenchSpec, flag: str, engines: str) -> tuple[Config, ServerSpec]:
    """The one pipeline and the server settings of a run that starts its own engines
    (``flag``: ``--fleet``, ``--pd``), or a :class:`BenchError` saying what is missing."""
    if spec.server is None or spec.url is not None:
        raise BenchError(f"{flag} starts its engines: give --model, not --url")
    if len(spec.configs) != 1 or spec.configs[0].pipeline is None:
        raise BenchError(f"{flag} runs one pipeline on {engines}: give one --config PIPELINE")
    if spec.rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {spec.rounds}")
    if spec.warm_up < 0:
        raise BenchError(f"--warm-up must be >= 0, got {spec.warm_up}")
    return spec.configs[0], spec.server


#: Starts of a fleet whose engine found a port taken before it could bind it.
PORT_ATTEMPTS = 3


@contextlib.contextmanager
def fleet(config: Config, spec: ServerSpec, n: int, workdir: Path) -> Iterator[list[Engine]]:
    """``n`` engines running ``config``, started side by side, healthy, each with its KV
    event publisher and its own CPU core(s); all stopped after, also when the body fails.

    Ports are chosen free and bound by the engines seconds later; one taken in
    between (by another process, or one of vLLM's own) stops that engine's start:
    the fleet is started again on new ports (:data:`PORT_ATTEMPTS` in all)."""
    if n < 1:
        raise BenchError(f"--fleet must be >= 1, got {n}")
    for attempt in range(1, PORT_ATTEMPTS + 1):
        engines, wanted = _fleet_specs(config, spec, n, workdir)
        stack = contextlib.ExitStack()
        try:
            started = stack.enter_context(servers(wanted))
        except PortTaken as exc:
            if attempt == PORT_ATTEMPTS:
                raise
            import structlog  # lazily: it costs `kvc --help` more than the rest

            structlog.get_logger("kv_composer").warning(
                "a port was taken before its engine bound it; the fleet starts again",
                attempt=attempt,
                error=str(exc).splitlines()[0],
            )
            continue
        with stack:
            yield [
                replace(e, url=s.url, pid=s.proc.pid)
                for e, s in zip(engines, started, strict=True)
            ]
        return


def _fleet_specs(
    config: Config, spec: ServerSpec, n: int, workdir: Path
) -> tuple[list[Engine], list[tuple[Config, ServerSpec, Path]]]:
    """Each engine's ports and server spec, the ports chosen now."""
    cores = os.cpu_count() or 1
    engines: list[Engine] = []
    wanted: list[tuple[Config, ServerSpec, Path]] = []
    for i in range(n):
        port, replay = free_port(), free_port()
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            # What a router that (re)subscribes missed: vLLM keeps the last
            # batches and sends them again on request.
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "",
        }
        engine = replace(
            spec,
            threads_bind=str(i % cores),
            cpus=str(i % cores),
            extra_args=[*spec.extra_args, "--kv-events-config", json.dumps(events)],
            # Dev mode: vLLM's /reset_prefix_cache; one hash seed across the fleet.
            env={**spec.env, "VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0"},
        )
        wanted.append((config, engine, workdir / f"engine-{i}.log"))
        # (Its URL once started.)
        engines.append(Engine("", f"tcp://{LOOPBACK}:{port}", f"tcp://{LOOPBACK}:{replay}"))
    return engines, wanted


def run_policy(
    spec: BenchSpec, engines: Sequence[Engine], p: Policy, prompts: Sequence[Prompt], log: Path
) -> RunResult:
    """The prompts through the router with policy ``p``, on emptied engines."""
    assert spec.server is not None
    for engine in engines:
        empty(engine.url)
    with vllm_router(
        [e.url for e in engines],
        p.args,
        log,
        kv_event_sources=event_sources(engines) if p.kv_events else None,
        block_size=spec.server.block_size,
    ) as router:
        cpu_before = cpu_seconds(router.pid)
        records, wall, deltas = replay_counted(spec, router.url, [e.url for e in engines], prompts)
        cpu_after = cpu_seconds(router.pid)
    nodes: dict[str, float] = {}
    for delta in deltas:
        for key, value in delta.items():
            if key.startswith("node:"):
                node = key.removeprefix("node:")
                nodes[node] = nodes.get(node, 0.0) + value
    return RunResult(
        p.name,
        records,
        wall,
        prompt_tokens=sum(d["prompt"] for d in deltas),
        prefix_cache_tokens=sum(d["prefix"] for d in deltas),
        connector_tokens=sum(d["connector"] for d in deltas),
        preemptions=int(sum(d["preemptions"] for d in deltas)),
        node_tokens=nodes,
        # Busiest first: engines are alike, and pooled runs add up like with like.
        engine_requests=sorted((d["requests"] for d in deltas), reverse=True),
        router_cpu_s=None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
        concurrency=spec.concurrency,
    )


def replay_counted(
    spec: BenchSpec, router: str, engines: Sequence[str], prompts: Sequence[Prompt]
) -> tuple[list[Record], float, list[dict[str, float]]]:
    """The prompts through ``router``: the requests' records, the wall time, and what
    each engine's counters gained (read around the replay, the last step's settled)."""
    model = served_model(router)
    before = [counters(url) for url in engines]
    records, wall = replay(
        router,
        model,
        prompts,
        concurrency=spec.concurrency,
        speedup=spec.speedup,
        pause_s=spec.pause_s,
    )
    time.sleep(SETTLE_S)
    after = [counters(url) for url in engines]
    deltas = [
        {k: v - b.get(k, 0.0) for k, v in a.items()} for a, b in zip(after, before, strict=True)
    ]
    return records, wall, deltas


def event_sources(engines: Sequence[Engine]) -> dict[str, tuple[str, str]]:
    """Each engine's KV event endpoints, as the router subscribes to them."""
    return {e.url: (e.events, e.replay) for e in engines}


def counters(url: str) -> dict[str, float]:
    return engine_counters(scrape.fetch(url))


def empty(url: str, attempts: int = 20) -> None:
    """vLLM's prefix cache and every node's tier emptied (vLLM refuses while blocks
    are held, e.g. by a save still in flight: tried again)."""
    for _ in range(attempts):
        request = urllib.request.Request(
            f"{url}/reset_prefix_cache?reset_external=true", method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            if json.loads(response.read()).get("success"):
                return
        time.sleep(0.5)
    raise BenchError(f"{url} did not empty its caches (/reset_prefix_cache)")
