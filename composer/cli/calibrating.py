"""``kvc calibrate``: fit ``kvc simulate --fleet``'s engine costs to ``kvc bench`` runs
(:mod:`composer.simulate.calibrate`), print them beside what they predict for each
run, and write the calibration file ``kvc simulate --calibration`` reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from composer.cli.common import CommandError
from composer.simulate.calibrate import fit, measured, read_bench, serve, write_calibration
from composer.simulate.cost import CALIBRATED, CostModel
from composer.simulate.shape import model_shape
from composer.simulate.tiers import SimulateError


def add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = ("Fit kvc simulate --fleet's engine costs to kvc bench runs of one engine "
            "(bench.json files; a run at --concurrency 1 and others at more).")
    p: argparse.ArgumentParser = sub.add_parser("calibrate", help=text, description=text)
    p.set_defaults(func=cmd_calibrate)
    p.add_argument("bench", nargs="+", type=Path, metavar="BENCH_JSON",
                   help="kvc bench's bench.json files (vLLM's prefix cache off, one engine)")
    p.add_argument("-o", "--output", type=Path, default=Path("calibration.json"),
                   help="the calibration file to write (default calibration.json)")
    p.add_argument("--block-size", type=int, default=16,
                   help="the engine's --block-size (default 16, vLLM's)")
    p.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="the measured model's config.json (or directory): its KV cache groups "
                   "share --num-gpu-blocks (default: one full-attention group)")
    for name, default in (("max-num-batched-tokens", CALIBRATED.max_num_batched_tokens),
                          ("max-num-seqs", CALIBRATED.max_num_seqs), ("num-gpu-blocks", 0)):
        p.add_argument(f"--{name}", type=int, default=default,
                       help=f"the engine's vLLM setting (default {default}"
                       + (": as many as the requests need)" if not default else ")"))


def cmd_calibrate(args: argparse.Namespace) -> int:
    try:
        for flag, value, least in (("--block-size", args.block_size, 1),
                                   ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                                   ("--max-num-seqs", args.max_num_seqs, 1),
                                   ("--num-gpu-blocks", args.num_gpu_blocks, 0)):
            if value < least:
                raise SimulateError(f"{flag} must be >= {least}, got {value}")
        runs, walls = read_bench(args.bench)
        limits = CostModel(0.0, 0.0, 0.0, 0.0, 0.0, args.max_num_batched_tokens,
                           args.max_num_seqs, args.num_gpu_blocks)
        groups = () if args.model_config is None else model_shape(
            args.model_config, args.block_size).groups
        cost = fit(runs, walls, limits, args.block_size, groups)
    except SimulateError as exc:
        raise CommandError(str(exc)) from None
    print("fitted:")
    for name, value in cost.as_dict().items():
        print(f"  {name} = {value:.4g}")
    print("\n| in flight | TTFT p50 ms measured (predicted) | TTFT p90 ms measured (predicted) "
          "| requests/s measured (predicted) |")
    print("| ---: | ---: | ---: | ---: |")
    checked = {}
    for n in sorted(runs):
        real = measured(runs[n], walls[n])
        sim = serve(runs[n], n, cost, args.block_size, groups)
        print(f"| {n} | {1000 * real.ttft(50):.1f} ({1000 * sim.ttft(50):.1f}) "
              f"| {1000 * real.ttft(90):.1f} ({1000 * sim.ttft(90):.1f}) "
              f"| {real.requests_per_s:.1f} ({sim.requests_per_s:.1f}) |")
        checked[str(n)] = {"measured": [real.ttft(50), real.ttft(90), real.requests_per_s],
                           "predicted": [sim.ttft(50), sim.ttft(90), sim.requests_per_s]}
    try:
        write_calibration(args.output, cost, checked)
    except OSError as exc:
        raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"\nwrote {args.output} (kvc simulate --fleet N --calibration {args.output})")
    return 0
