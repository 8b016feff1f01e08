"""``kvc simulate`` and ``kvc bench``: predict hit rates on a trace with no engine, and
measure them on real servers.

Their modules (:mod:`composer.simulate`, :mod:`composer.bench`) load neither torch
nor vLLM (matplotlib only inside the plots), so they are imported here at the top.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from composer import trace as traces
from composer.bench import report as bench_report
from composer.bench import run as bench_run
from composer.bench.replay import BenchError, trace_block_tokens
from composer.bench.servers import Config, ServerSpec
from composer.bench.spec import BenchSpec
from composer.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    CommandError,
    dump,
    load,
    stop_servers_on_sigterm,
)
from composer.cli.fleet import FLEET_ONLY, plot_path, simulate_fleet_command
from composer.cli.logs import configure
from composer.discovery import discover
from composer.errors import escape
from composer.pipeline import ResolvedPipeline
from composer.simulate import SimulateError, simulate
from composer.simulate.generate import generate, shape_from
from composer.simulate.report import format_result, format_sweep, plot_sweep
from composer.simulate.shape import model_shape
from composer.simulate.sweep import parse_sweep, sweep
from composer.trace import TraceRequest, write_trace

#: ``kvc simulate --strict``'s exit status when a cache policy raised and was switched off.
EXIT_POLICY_FAILED = 1


def cmd_simulate(args: argparse.Namespace) -> int:
    with _logs_on_stderr():
        return _simulate_command(args)


def _simulate_command(args: argparse.Namespace) -> int:
    pipeline = load(args.file, discover())
    try:
        kwargs: dict[str, Any] = _sizes(args, pipeline)
        trace = traces.read_trace(args.trace)
        kwargs |= {
            "trace_block_tokens": args.trace_block_tokens,
            "vllm_cache_blocks": args.vllm_cache_blocks,
            "trace_name": os.path.basename(args.trace),
            "exact": args.exact,
        }
        if args.fleet is not None:
            text, failures = simulate_fleet_command(args, pipeline, trace, kwargs)
        elif given := [k for k, v in FLEET_ONLY.items() if getattr(args, k) != v]:
            flag = "--" + given[0].replace("_", "-")
            raise SimulateError(f"{flag} is a fleet's: give --fleet N too")
        elif args.sweep is None:
            text, failures = _simulate_once(args, pipeline, trace, kwargs)
        else:
            text, failures = _simulate_sweep(args, pipeline, trace, kwargs)
    except traces.TraceError as exc:
        print(escape(str(exc)), file=sys.stderr)
        return EXIT_INVALID
    except (SimulateError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    else:
        print(text)
    if failures and args.strict:
        print(
            "kvc: error: --strict: a cache policy raised and was switched off "
            f"({len(failures)} in all); the figures after the switch are its fallback's:",
            file=sys.stderr,
        )
        for line in failures:
            print(f"  {escape(line)}", file=sys.stderr)
        return EXIT_POLICY_FAILED
    return EXIT_OK


@contextlib.contextmanager
def _logs_on_stderr() -> Iterator[None]:
    """Every log line of a simulation (a cache policy switched off, a node's warning) on
    stderr: stdout is the report, and ``--json``'s must parse. structlog's default
    writes to stdout; ``kvc -v`` has configured it already (on stderr). structlog's
    defaults come back afterwards, and no logger keeps this set-up (a command run
    inside another program, a test, leaves its logging as it was)."""
    import structlog  # lazily: only a simulation's models log

    if structlog.is_configured():
        yield
        return
    configure(level=logging.WARNING)
    structlog.configure(cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.reset_defaults()


def _sizes(args: argparse.Namespace, pipeline: ResolvedPipeline) -> dict[str, Any]:
    """``simulate``'s block size, bytes per block and KV cache groups."""
    if args.bytes_per_block is not None:
        try:
            bpb = int(TypeAdapter(ByteSize).validate_python(args.bytes_per_block))
        except ValidationError:
            raise CommandError(
                f"--bytes-per-block: not a size: {args.bytes_per_block!r} (e.g. 2MiB)"
            ) from None
        return {"bytes_per_block": bpb, "block_size": args.block_size}
    if args.model_config is not None:
        shape = model_shape(args.model_config, args.block_size, pipeline)
        return {
            "bytes_per_block": shape.bytes_per_block,
            "block_size": shape.block_size,
            "groups": shape.groups,
            "notes": shape.notes,
        }
    raise CommandError("kvc simulate needs --bytes-per-block or --model-config")


def _simulate_once(
    args: argparse.Namespace,
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    kwargs: dict[str, Any],
) -> tuple[str, list[str]]:
    """The report, and each cache policy switched off (as every ``_simulate_*``)."""
    result = simulate(pipeline, trace, **kwargs)
    text = dump(result.as_dict()) if args.json else format_result(result)
    return text, result.policy_failures


def _simulate_sweep(
    args: argparse.Namespace,
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    kwargs: dict[str, Any],
) -> tuple[str, list[str]]:
    name, values = parse_sweep(args.sweep)
    results = sweep(pipeline, trace, name, values, **kwargs)
    png = plot_path(args)
    plot_sweep(png, name, values, results)
    print(f"wrote {png}", file=sys.stderr)
    failures = [
        f"{name}={v}: {line}"
        for v, r in zip(values, results, strict=True)
        for line in r.policy_failures
    ]
    if args.json:
        return dump({"sweep": name, "values": values, "plot": str(png),
                     "results": [r.as_dict() for r in results]}), failures
    return format_sweep(name, values, results), failures


def cmd_trace_generate(args: argparse.Namespace) -> int:
    try:
        shape = shape_from(vars(args))
    except SimulateError as exc:
        raise CommandError(str(exc)) from None
    requests = generate(shape)
    try:
        write_trace(args.output, requests)
    except OSError as exc:
        raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    tenants = len({r.tenant for r in requests})
    print(
        f"wrote {args.output}: {len(requests):,} requests, {tenants} tenants, "
        f"{sum(r.input_length for r in requests):,} prompt tokens over "
        f"{requests[-1].timestamp_ms / 1000:,.0f} s (seed {shape.seed})",
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    stop_servers_on_sigterm()
    try:
        trace = traces.read_trace(args.trace, limit=args.limit)
    except traces.TraceError as exc:
        print(escape(str(exc)), file=sys.stderr)
        return EXIT_INVALID
    try:
        spec = _bench_spec(args, trace)
        results = bench_run.run(spec)
        written = bench_report.write_report(results, spec.workdir, plot=not args.no_plot)
    except BenchError as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(dump([r.summary() for r in results]))
    else:
        print(bench_report.markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return EXIT_OK


def _bench_spec(args: argparse.Namespace, trace: Sequence[TraceRequest]) -> BenchSpec:
    trace_block_tokens(args.scale)  # refused before any server starts
    if (args.model is None) == (args.url is None):
        raise BenchError("kvc bench needs exactly one of --model and --url")
    if args.url is not None and args.config:
        raise BenchError("--config starts servers: give --model, not --url")
    if args.fleet is not None and args.fleet < 1:
        raise BenchError(f"--fleet must be >= 1, got {args.fleet}")
    if args.policy and not (args.fleet or args.pd):
        raise BenchError("--policy chooses the router's policy: give --fleet N or --pd too")
    if args.warm_up < 0:
        raise BenchError(f"--warm-up must be >= 0, got {args.warm_up}")
    if args.warm_up and not args.fleet:
        raise BenchError("--warm-up warms a fleet's engines: give --fleet N too")
    configs = [Config.parse(c) for c in (args.config or ["none", "prefix"])]
    if args.pipeline_prefix_cache == "off":
        configs = [
            Config(c.name, c.pipeline, prefix_caching=False) if c.pipeline else c
            for c in configs
        ]
    server = None
    if args.model is not None:
        server = ServerSpec(
            model=args.model,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            num_blocks=args.num_gpu_blocks,
            kv_cache_gib=args.kv_cache_gib,
            extra_args=list(args.vllm_arg or []),
        )
    return BenchSpec(
        trace=trace,
        configs=configs,
        server=server,
        url=args.url,
        scale=args.scale,
        concurrency=args.concurrency,
        speedup=args.speedup,
        max_output_tokens=args.max_output_tokens,
        vocab_size=args.vocab_size,
        workdir=Path(args.output),
        progress=not args.no_progress,
        rounds=args.rounds,
        fleet=args.fleet or 0,
        policies=args.policy or (),
        warm_up=args.warm_up,
        pd=args.pd,
    )
