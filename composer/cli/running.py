"""``kvc serve``, ``kvc demo`` and ``kvc top``: commands that run or watch a vLLM server.

vLLM and torch are imported where the command runs them, never at import time, and
``kvc top``'s rich inside its command: ``kvc --help`` stays light.
"""

from __future__ import annotations

import argparse

from composer.cli.common import CommandError, needs_runtime, stop_servers_on_sigterm
from composer.cli.demo import main as demo_main
from composer.cli.serve import serve


def cmd_serve(args: argparse.Namespace) -> int:
    vllm_args = list(args.vllm_args)
    if vllm_args[:1] == ["--"]:
        vllm_args = vllm_args[1:]
    with needs_runtime("kvc serve"):
        return serve(args.file, vllm_args, valkey=args.valkey, kv_role=args.kv_role)


def cmd_demo(args: argparse.Namespace) -> int:
    stop_servers_on_sigterm()
    with needs_runtime("kvc demo"):
        return demo_main(args.file)


def cmd_top(args: argparse.Namespace) -> int:
    from composer.cli import top

    if args.interval <= 0:
        raise CommandError(f"--interval must be > 0, got {args.interval}")
    try:
        return top.run(args.url, interval=args.interval, once=args.once)
    except OSError as exc:
        raise CommandError(f"cannot scrape {args.url}: {exc}") from None
