"""``kvc bench --pd``: a prefill and a decode engine behind vLLM's router in its P/D mode,
against the same two engines without P/D.

Both engines are ``kvc serve`` of the one ``--config`` pipeline (which needs a
transport node, e.g. ``examples/pd-nixl.yaml``): engine 0 as the producer
(``--kv-role producer``), engine 1 as the consumer, one CPU core each, each
with its own NIXL side channel on loopback. They start once. Then, per mode,
their caches are emptied (as :mod:`.fleet` does), vLLM's router is started in
front and the trace's prompts are replayed through it:

* ``pd``: ``vllm-router --vllm-pd-disaggregation``: each request prefilled on
  engine 0 (``do_remote_decode``, one token), then decoded on engine 1, which
  pulls the prompt's KV over NIXL with the ``kv_transfer_params`` that came
  back;
* ``plain``: the router over the same two engines as peers (``--policy``,
  default ``cache_aware``), each request computed where it lands.

Each mode's row has the client's TTFT, the prompt tokens each node served on
each engine (``prefill:cpu``, ``decode:nixl``; ``engine-0``/``engine-1`` for
``plain``) and the bytes NIXL moved. ``rounds`` alternates the modes' order
and pools each one's requests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from composer.bench.fleet import Policy, empty, own_engines, policy, replay_counted
from composer.bench.replay import BenchError, Prompt, send, served_model
from composer.bench.report import RunResult, pool
from composer.bench.servers import Config, Server, ServerSpec, servers
from composer.bench.spec import BenchSpec, bench_prompts
from composer.servers.loopback import LOOPBACK, free_port
from composer.servers.vllm_router import Disaggregated, vllm_router

MODES = ("pd", "plain")
#: The plain mode's routing policy when ``--policy`` gives none: the router's default.
PLAIN_POLICY = "cache_aware"


@dataclass(frozen=True)
class PDEngines:
    prefill: Server
    decode: Server


def run_pd(spec: BenchSpec) -> list[RunResult]:
    """Both modes on one pair of engines (started once, emptied before each mode)."""
    config, server = own_engines(spec, "--pd", "both engines")
    if len(spec.policies) > 1:
        raise BenchError("--pd takes at most one --policy (the plain mode's)")
    plain = policy(spec.policies[0] if spec.policies else PLAIN_POLICY)
    if plain.kv_events:
        raise BenchError(f"--pd: --policy {plain.name} needs KV events; the P/D engines have none")
    prompts, skipped = bench_prompts(spec)
    spec.workdir.mkdir(parents=True, exist_ok=True)
    pooled: dict[str, RunResult] = {}
    with pd_engines(config, server, spec.workdir) as engines:
        warm_up(engines, prompts[0], spec.workdir / "router-warm-up.log")
        for round_index in range(spec.rounds):
            for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                log = spec.workdir / f"router-{mode}-{round_index + 1}.log"
                result = run_mode(spec, engines, mode, plain, prompts, log)
                result.skipped = skipped
                pooled[mode] = pool(pooled[mode], result) if mode in pooled else result
    return [pooled[mode] for mode in MODES]


@contextlib.contextmanager
def pd_engines(
    config: Config,
    spec: ServerSpec,
    workdir: Path,
    own_args: tuple[Sequence[str], Sequence[str]] = ((), ()),
) -> Iterator[PDEngines]:
    """The producer and the consumer engine, started side by side, healthy; both stopped
    after, also when the body fails. ``own_args``: more ``vllm serve`` arguments for
    the producer and for the consumer."""
    cores = os.cpu_count() or 1
    wanted = []
    for i, role in enumerate(("producer", "consumer")):
        extra = [*spec.extra_args, *own_args[i]]
        if not any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
            # vLLM's CPU build with NIXL loaded: bfloat16 died with Illegal instruction
            # in cpu_attention_with_kv_cache on the decode engine; float32 does not.
            extra += ["--dtype", "float32"]
        engine = replace(
            spec,
            kv_role=role,
            threads_bind=str(i % cores),
            extra_args=extra,
            env={
                **spec.env,
                # Dev mode: vLLM's /reset_prefix_cache (and /collective_rpc).
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            },
        )
        wanted.append((config, engine, workdir / f"{role}.log"))
    with servers(wanted) as (prefill, decode):
        yield PDEngines(prefill, decode)


def warm_up(engines: PDEngines, prompt: Prompt, log: Path) -> None:
    """One request through the P/D router, not measured: an engine's first request pays
    for warming it up, the decode engine's first NIXL pull for the handshake."""
    disaggregated = Disaggregated([engines.prefill.url], [engines.decode.url])
    with vllm_router(disaggregated, (), log) as router:
        record = send(router.url, served_model(router.url), replace(prompt, max_tokens=1))
    if record.error is not None:
        raise BenchError(f"the warm-up request through the P/D router failed: {record.error}")


def run_mode(
    spec: BenchSpec,
    engines: PDEngines,
    mode: str,
    plain: Policy,
    prompts: Sequence[Prompt],
    log: Path,
) -> RunResult:
    """The prompts through the router in ``mode``, on emptied engines."""
    urls = [engines.prefill.url, engines.decode.url]
    workers: Sequence[str] | Disaggregated = urls
    labels, name = ["engine-0", "engine-1"], f"plain ({plain.name})"
    if mode == "pd":
        workers = Disaggregated(urls[:1], urls[1:])
        labels, name = ["prefill", "decode"], "pd"
    for url in urls:
        empty(url)
    with vllm_router(workers, plain.args, log) as router:
        records, wall, deltas = replay_counted(spec, router.url, urls, prompts)
    sides = {
        f"{label}:{key.removeprefix('served:')}": value
        for label, delta in zip(labels, deltas, strict=True)
        for key, value in delta.items()
        if key.startswith("served:")
    }
    return RunResult(
        name,
        records,
        wall,
        prompt_tokens=sum(d["prompt"] for d in deltas),
        prefix_cache_tokens=sum(d["prefix"] for d in deltas),
        connector_tokens=sum(d["connector"] for d in deltas),
        preemptions=int(sum(d["preemptions"] for d in deltas)),
        engine_requests=[d["requests"] for d in deltas],
        side_tokens=sides,
        nixl_bytes=sum(d["nixl_bytes"] for d in deltas),
    )

