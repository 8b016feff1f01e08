"""Dispatch overhead: the composed connector against vLLM's MultiConnector.

Both sides wrap the same N no-op children, N = 1, 3, 8, loaded by vLLM's factory
through ``kv_connector_module_path = "benchmarks.noop_connector"``: ``NoopConnector``
keeps vLLM's do-nothing defaults for optional methods (the composed connector
leaves a child out of a hook it keeps the default for), ``NoopFullConnector``
overrides every method (every hook is dispatched on both sides: the pure cost of
dispatch). The connectors are driven directly (no engine) with real vLLM objects:
a ``VllmConfig`` with a ``KVTransferConfig``, a ``KVCacheConfig`` with one
full-attention group of 24 layers, a ``SchedulerOutput`` with a new and a running
request, a ``KVConnectorOutput``.

Measured, per call of what vLLM calls:

* per attention layer: ``wait_for_layer_load`` + ``save_kv_layer`` (24 layers
  per forward, reported per layer);
* per worker step: ``handle_preemptions``, ``bind_connector_metadata``,
  ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``,
  ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
  ``get_kv_connector_kv_cache_events``, ``build_connector_worker_meta``,
  ``clear_connector_metadata``;
* per scheduler step: ``build_connector_meta``, ``update_connector_output``,
  ``get_kv_connector_stats``, ``take_events``.

The composed side is also run with KV Composer plugin nodes that implement a
few hooks (``save_kv_layer`` + ``wait_for_save``) next to nodes that implement
none, to show what a node without the hook costs (target: nothing).

Target: composed / MultiConnector <= 1.0x everywhere. Timings are printed,
never asserted: the machine is shared and noisy, so every number is the median
of many short samples in interleaved rounds, and each ratio is the median of
per-round ratios (both sides of a pair measured side by side).

``python -m benchmarks.dispatch [--rounds R] [--detail]``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(24)]
NOOP_MODULE = "benchmarks.noop_connector"
#: The children: keeping vLLM's defaults for optional methods, or overriding all.
CHILDREN = {
    "NoopConnector": "no-op children that keep vLLM's defaults for optional methods",
    "NoopFullConnector": "no-op children that override every method (pure dispatch cost)",
}
NODES_MODULE = "benchmarks.dispatch_nodes"
SAMPLE_S = 0.0002  # one timed sample: short, so that few samples see the CPU taken away
TARGET = 1.0


# --------------------------------------------------------------------------- #
# building real vLLM objects
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence vLLM's and KV Composer's per-connector start-up logging."""
    import structlog

    old_config = structlog.get_config()
    vllm_log = logging.getLogger("vllm")
    old_level = vllm_log.level
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    vllm_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_log.setLevel(old_level)
        structlog.configure(**old_config)


def _env_plugins() -> None:
    mods = [m for m in os.environ.get("KV_COMPOSER_PLUGIN_MODULES", "").split(",") if m.strip()]
    if NODES_MODULE not in mods:
        os.environ["KV_COMPOSER_PLUGIN_MODULES"] = ",".join([*mods, NODES_MODULE])


class World:
    """One VllmConfig / KVCacheConfig / step objects shared by every connector."""

    def __init__(self) -> None:
        import torch
        from vllm.config import VllmConfig
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        self.KVTransferConfig = KVTransferConfig
        self.base = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="NoopConnector",
                kv_connector_module_path="benchmarks.noop_connector",
                kv_role="kv_both",
            )
        )
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=256,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)],
        )
        # A step with one new request (prefill) and one running request (decode).
        new = NewRequestData(
            req_id="new-0",
            prompt_token_ids=list(range(100)),
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=([0, 1, 2, 3, 4, 5, 6],),
            num_computed_tokens=0,
            lora_request=None,
        )
        cached = CachedRequestData.make_empty()
        cached.req_ids.append("run-0")
        cached.new_token_ids.append([])
        cached.new_block_ids.append(None)
        cached.num_computed_tokens.append(64)
        cached.num_output_tokens.append(3)
        self.scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={"new-0": 100, "run-0": 1},
            total_num_scheduled_tokens=101,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        self.kv_layer = torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)
        self.attn_metadata = object()

    @property
    def engine_id(self) -> str:
        assert self.base.kv_transfer_config is not None
        return str(self.base.kv_transfer_config.engine_id)

    def config(self, kv_connector: str, module_path: str, extra: dict[str, Any]) -> Any:
        cfg = copy.copy(self.base)
        cfg.kv_transfer_config = self.KVTransferConfig(
            kv_connector=kv_connector,
            kv_connector_module_path=module_path,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            engine_id=self.engine_id,
        )
        return cfg

    def multi(self, n: int, role: Any, child_cls: str = "NoopConnector") -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

        child = {
            "kv_connector": child_cls,
            "kv_connector_module_path": NOOP_MODULE,
            "kv_role": "kv_both",
        }
        cfg = self.config(
            "MultiConnector",
            "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
            {"connectors": [dict(child) for _ in range(n)]},
        )
        return MultiConnector(cfg, role, self.kv_cache_config)

    def composed(self, nodes: dict[str, Any], role: Any) -> Any:
        from composer.vllm.connector import ComposedConnector

        pipeline = {"version": 1, "nodes": nodes}
        cfg = self.config("ComposedConnector", "composer.vllm.connector", {"pipeline": pipeline})
        return ComposedConnector(cfg, role, self.kv_cache_config)


def native_nodes(n: int, child_cls: str = "NoopConnector") -> dict[str, Any]:
    config = {"connector": child_cls, "module_path": NOOP_MODULE}
    return {f"native{i}": {"plugin": "vllm", "config": dict(config)} for i in range(n)}


def plugin_nodes(savers: int, empties: int) -> dict[str, Any]:
    nodes = {f"saver{i}": {"plugin": "dispatch-saver"} for i in range(savers)}
    nodes.update({f"empty{i}": {"plugin": "dispatch-empty"} for i in range(empties)})
    return nodes


# --------------------------------------------------------------------------- #
# what vLLM calls
# --------------------------------------------------------------------------- #


@dataclass
class Pair:
    """A scheduler-side and a worker-side connector of one configuration."""

    label: str
    scheduler: Any
    worker: Any
    world: World

    def __post_init__(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        # One full round trip, so the worker binds what the scheduler built.
        self.metadata = self.scheduler.build_connector_meta(self.world.scheduler_output)
        self.output = KVConnectorOutput(
            kv_connector_worker_meta=self.worker.build_connector_worker_meta()
        )

    def forward(self) -> Callable[[], None]:
        """One forward: 24 attention layers."""
        w = self.worker
        layers, kv, attn = LAYERS, self.world.kv_layer, self.world.attn_metadata

        def run() -> None:
            for name in layers:
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, kv, attn)

        return run

    def worker_calls(self) -> list[tuple[str, Callable[[], Any]]]:
        w, meta = self.worker, self.metadata
        finished = self.world.scheduler_output.finished_req_ids
        return [
            ("handle_preemptions", lambda: w.handle_preemptions(meta)),
            ("bind_connector_metadata", lambda: w.bind_connector_metadata(meta)),
            ("start_load_kv", lambda: w.start_load_kv(None)),
            ("wait_for_save", w.wait_for_save),
            ("get_transfer_results", lambda: w.get_transfer_results(finished)),
            ("get_block_ids_with_load_errors", w.get_block_ids_with_load_errors),
            ("get_kv_connector_stats", w.get_kv_connector_stats),
            ("get_kv_connector_kv_cache_events", w.get_kv_connector_kv_cache_events),
            ("build_connector_worker_meta", w.build_connector_worker_meta),
            ("clear_connector_metadata", w.clear_connector_metadata),
        ]

    def worker_step(self) -> Callable[[], None]:
        w, meta = self.worker, self.metadata
        finished = self.world.scheduler_output.finished_req_ids

        def run() -> None:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            w.get_transfer_results(finished)
            w.get_block_ids_with_load_errors()
            w.get_kv_connector_stats()
            w.get_kv_connector_kv_cache_events()
            w.build_connector_worker_meta()
            w.clear_connector_metadata()

        return run

    def scheduler_calls(self) -> list[tuple[str, Callable[[], Any]]]:
        s, out, so = self.scheduler, self.output, self.world.scheduler_output

        def events() -> None:
            ev = s.take_events()
            if ev:
                list(ev)

        return [
            ("build_connector_meta", lambda: s.build_connector_meta(so)),
            ("update_connector_output", lambda: s.update_connector_output(out)),
            ("get_kv_connector_stats", s.get_kv_connector_stats),
            ("take_events", events),
        ]

    def scheduler_step(self) -> Callable[[], None]:
        s, out, so = self.scheduler, self.output, self.world.scheduler_output

        def run() -> None:
            s.build_connector_meta(so)
            s.update_connector_output(out)
            s.get_kv_connector_stats()
            ev = s.take_events()
            if ev:
                list(ev)

        return run


def make_pair(world: World, label: str, build: Callable[[Any], Any]) -> Pair:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with quiet():
        return Pair(label, build(KVConnectorRole.SCHEDULER), build(KVConnectorRole.WORKER), world)


# --------------------------------------------------------------------------- #
# timing
# --------------------------------------------------------------------------- #


def _loops(fn: Callable[[], Any]) -> int:
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 > SAMPLE_S / 5:
            return max(1, int(n * SAMPLE_S / (time.perf_counter() - t0)))
        n *= 4


def _sample(fn: Callable[[], Any], n: int) -> float:
    r = range(n)
    t0 = time.perf_counter()
    for _ in r:
        fn()
    return (time.perf_counter() - t0) / n


def _empty() -> None:
    return None


def measure(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, one sample per round; rounds interleave every fn.

    The order rotates and flips from round to round, so that a pair measured
    side by side sees the same machine; the harness's own call of ``fn()`` is
    subtracted.
    """
    loops = {k: _loops(f) for k, f in fns.items()}
    keys = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    overhead: list[float] = []
    n_empty = _loops(_empty)
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            if r % 2:
                order.reverse()
            overhead.append(_sample(_empty, n_empty))
            for k in order:
                samples[k].append(_sample(fns[k], loops[k]))
    finally:
        if gc_was:
            gc.enable()
    call = statistics.median(overhead)
    return {k: [max(1e-12, x - call) for x in v] for k, v in samples.items()}


def _layer_loop_overhead(rounds: int) -> float:
    """The 24-iteration loop itself, without calls (subtracted from forward timings)."""
    layers = LAYERS

    def run() -> None:
        for _name in layers:
            pass

    return statistics.median(measure({"loop": run}, rounds)["loop"])


@dataclass
class Timing:
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def ratio_to(self, other: Timing) -> float:
        """Median over rounds of self/other (each round measured the two side by side)."""
        return statistics.median(a / b for a, b in zip(self.samples, other.samples, strict=True))


# --------------------------------------------------------------------------- #
# report
# --------------------------------------------------------------------------- #


def us(seconds: float) -> str:
    return f"{seconds * 1e6:7.2f}"


def fmt_ratio(r: float) -> str:
    return f"{r:5.2f}x" + (" " if r <= TARGET else "!")


KINDS = ("layer", "worker step", "sched step")


def kind_fns(pair: Pair, kind: str) -> Callable[[], Any]:
    if kind == "layer":
        return pair.forward()
    if kind == "worker step":
        return pair.worker_step()
    return pair.scheduler_step()


def time_kinds(pairs: dict[str, Pair], rounds: int, loop: float) -> dict[str, dict[str, Timing]]:
    """label -> kind -> Timing; per-layer samples are per layer, the loop subtracted."""
    out: dict[str, dict[str, Timing]] = {label: {} for label in pairs}
    for kind in KINDS:
        samples = measure({label: kind_fns(p, kind) for label, p in pairs.items()}, rounds)
        for label, v in samples.items():
            if kind == "layer":
                v = [max(1e-12, x - loop) / len(LAYERS) for x in v]
            out[label][kind] = Timing(v)
    return out


def run(rounds: int = 201, detail: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """Measure and print; returns {group: {label: {kind: median seconds}}}."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from benchmarks.noop_connector import NoopFullConnector

    _env_plugins()
    with quiet():
        world = World()
    sizes = (1, 3, 8)
    loop = _layer_loop_overhead(rounds)
    print(
        f"python {sys.version.split()[0]}; medians of {rounds} interleaved rounds; µs per call; "
        "ratio = median of per-round composed/multi (target <= 1.00)"
    )
    print(
        "per layer = wait_for_layer_load + save_kv_layer (24 layers per forward); worker step = "
        "handle_preemptions .. clear_connector_metadata; sched step = build_connector_meta, "
        "update_connector_output, get_kv_connector_stats, take_events"
    )
    print()
    report: dict[str, dict[str, dict[str, float]]] = {}
    by_cls: dict[str, dict[str, Pair]] = {}
    for cls, title in CHILDREN.items():
        pairs: dict[str, Pair] = {}
        for n in sizes:
            multi = functools.partial(world.multi, n, child_cls=cls)
            pairs[f"multi{n}"] = make_pair(world, f"multi{n}", multi)
            composed = functools.partial(world.composed, native_nodes(n, cls))
            pairs[f"comp{n}"] = make_pair(world, f"comp{n}", composed)
        by_cls[cls] = pairs
        t = time_kinds(pairs, rounds, loop)
        report[cls] = {label: {k: v.median for k, v in kinds.items()} for label, kinds in t.items()}
        print(f"MultiConnector vs ComposedConnector over N {title} ({cls})")
        head = f"{'N':>3} | " + " | ".join(f"{k:^24}" for k in KINDS)
        print(head)
        print(f"{'':>3} | " + " | ".join(f"{'multi':>7} {'comp':>7} {'ratio':>7} " for _ in KINDS))
        print("-" * len(head))
        for n in sizes:
            m, c = t[f"multi{n}"], t[f"comp{n}"]
            cells = [
                f"{us(m[k].median)} {us(c[k].median)} {fmt_ratio(c[k].ratio_to(m[k]))}"
                for k in KINDS
            ]
            print(f"{n:>3} | " + " | ".join(cells))
        print()

    # Reference: one child called directly, no dispatch at all.
    with quiet():
        cfg = world.config("NoopFullConnector", NOOP_MODULE, {})
        direct = Pair(
            "direct",
            NoopFullConnector(cfg, KVConnectorRole.SCHEDULER, world.kv_cache_config),
            NoopFullConnector(cfg, KVConnectorRole.WORKER, world.kv_cache_config),
            world,
        )
    extra = {
        "saver": plugin_nodes(1, 0),
        "saver+7empty": plugin_nodes(1, 7),
        "native": native_nodes(1, "NoopFullConnector"),
        "native+7empty": {**native_nodes(1, "NoopFullConnector"), **plugin_nodes(0, 7)},
        "8empty": plugin_nodes(0, 8),
    }
    pairs = {
        label: make_pair(world, label, functools.partial(world.composed, nodes))
        for label, nodes in extra.items()
    }
    pairs["direct"] = direct
    t = time_kinds(pairs, rounds, loop)
    report["plugins"] = {
        label: {k: v.median for k, v in kinds.items()} for label, kinds in t.items()
    }
    d = t["direct"]
    print(
        "one NoopFullConnector called directly (no dispatch): "
        + ", ".join(f"{k} {us(d[k].median).strip()}" for k in KINDS)
    )
    print()
    print("KV Composer plugin nodes (composed only): what nodes that implement no hook cost")
    print(f"{'chain':<40} | " + " | ".join(f"{k:>11}" for k in KINDS))
    rows = [
        ("1 saver (save_kv_layer + wait_for_save)", "saver"),
        ("1 saver + 7 nodes with no hooks", "saver+7empty"),
        ("1 native (NoopFull)", "native"),
        ("1 native (NoopFull) + 7 nodes, no hooks", "native+7empty"),
        ("8 nodes with no hooks", "8empty"),
    ]
    for title, label in rows:
        print(f"{title:<40} | " + " | ".join(f"{us(t[label][k].median):>11}" for k in KINDS))
    for a, b, what in (("saver+7empty", "saver", "saver"), ("native+7empty", "native", "native")):
        diff = " | ".join(f"{(t[a][k].median - t[b][k].median) * 1e6:+11.2f}" for k in KINDS)
        print(f"{'  7 no-hook nodes add (to 1 ' + what + ')':<40} | {diff}")

    if detail:
        for cls, cls_pairs in by_cls.items():
            for side, getter in (
                ("worker", Pair.worker_calls),
                ("scheduler", Pair.scheduler_calls),
            ):
                print()
                print(f"per method, {side} side, {cls} children (µs per call: multi, comp, ratio)")
                names = [name for name, _ in getter(cls_pairs["multi1"])]
                per: dict[int, dict[str, list[float]]] = {}
                for n in sizes:
                    fns = {}
                    for name, fn in getter(cls_pairs[f"multi{n}"]):
                        fns[f"m:{name}"] = fn
                    for name, fn in getter(cls_pairs[f"comp{n}"]):
                        fns[f"c:{name}"] = fn
                    # multi and composed of one method side by side in every round
                    fns = {k: fns[k] for name in names for k in (f"m:{name}", f"c:{name}")}
                    per[n] = measure(fns, max(31, rounds // 2))
                print(f"{'method':<34} | " + " | ".join(f"{'N=' + str(n):^23}" for n in sizes))
                for name in names:
                    cells = []
                    for n in sizes:
                        tm, tc = Timing(per[n][f"m:{name}"]), Timing(per[n][f"c:{name}"])
                        cells.append(
                            f"{us(tm.median)} {us(tc.median)} {fmt_ratio(tc.ratio_to(tm))}"
                        )
                    print(f"{name:<34} | " + " | ".join(cells))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dispatch", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--rounds", type=int, default=201, help="interleaved rounds per measurement (median)"
    )
    parser.add_argument(
        "--detail", action="store_true", help="also time every per-step method alone"
    )
    # Under `python -m benchmarks` main() gets no arguments: the defaults apply.
    args = parser.parse_args([] if argv is None else argv)
    run(args.rounds, args.detail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
