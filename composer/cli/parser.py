"""``kvc``'s command line: the global options and one ``add_<command>`` a subcommand.

Each ``add_<command>`` declares its arguments and the function that runs it;
:data:`COMMANDS` is their order in ``kvc --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from composer.cli.calibrating import add_calibrate
from composer.cli.fleet import add_fleet_options
from composer.cli.measuring import cmd_bench, cmd_simulate, cmd_trace_generate
from composer.cli.running import cmd_demo, cmd_serve, cmd_top
from composer.cli.showing import cmd_graph, cmd_plugins
from composer.cli.validating import SCHEMA_FILE, cmd_export, cmd_schema, cmd_validate
from composer.loader import MAX_DEPTH, MAX_FILE_BYTES, MAX_NUMBER_CHARS, MAX_VALUES

if TYPE_CHECKING:
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvc",
        description="KV Composer: compose vLLM KV-cache connectors from a validated YAML "
        "graph of plugins.",
        epilog="Exit codes: 0 ok, 1 environment problem (e.g. vLLM missing), "
        "2 invalid pipeline or usage.",
    )
    parser.add_argument(
        "--json", action="store_true", help="machine-readable output where a command has it"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def _add(
    sub: Subparsers, name: str, func: Callable[[argparse.Namespace], int], help: str
) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    p.set_defaults(func=func)
    return p


def _add_json(p: argparse.ArgumentParser) -> None:
    # SUPPRESS keeps a global `kvc --json validate` from being reset by the subcommand.
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="JSON output"
    )


def _add_kv_role(p: argparse.ArgumentParser, what: str) -> None:
    # One pipeline file serves both sides of disaggregated prefill/decode.
    p.add_argument(
        "--kv-role",
        choices=("producer", "consumer", "both"),
        help=f"the P/D side {what}: producer (prefill), consumer (decode) or both; "
        "default: the file's kv_role",
    )


def add_validate(sub: Subparsers) -> None:
    p = _add(sub, "validate", cmd_validate, "Validate pipeline files; report every problem.")
    p.epilog = (
        f"Limits (each reported where it is crossed): files of at most {MAX_FILE_BYTES:,} "
        f"bytes, regular files or stdin only; nesting at most {MAX_DEPTH} levels; at most "
        f"{MAX_VALUES:,} values once aliases are expanded; numbers of at most "
        f"{MAX_NUMBER_CHARS} characters."
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="pipeline YAML file ('-' for stdin)")
    p.add_argument(
        "--deep",
        action="store_true",
        help=(
            "also import every node class (per vLLM process) and check it against the hook "
            "spec, and vLLM-native connector names against the installed vLLM (imports the "
            "plugins' runtime modules, and vLLM when the pipeline has vllm nodes)"
        ),
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help=(
            "also check that every node can follow vLLM's sleep mode, as `kvc serve -- "
            "--enable-sleep-mode` does before launch (imports the node classes, and vLLM "
            "when the pipeline has vllm nodes: their connector classes answer)"
        ),
    )
    _add_kv_role(p, "to check the pipelines for")
    _add_model(p)
    _add_json(p)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="MODEL",
        help=(
            "a local model directory (or its config.json): show the KV cache groups vLLM will "
            "form for it and what each node serves; a node that cannot serve it is an error "
            "(reads config.json only: no weights, no vLLM)"
        ),
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        metavar="N",
        help="vLLM's --block-size for --model (default 32)",
    )


def add_graph(sub: Subparsers) -> None:
    p = _add(
        sub, "graph", cmd_graph, "Draw a pipeline: nodes, roles, needs, load order, save targets."
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("text", "mermaid"), default="text")
    _add_kv_role(p, "to check the pipeline for")
    _add_model(p)
    _add_json(p)


def add_plugins(sub: Subparsers) -> None:
    p = _add(sub, "plugins", cmd_plugins, "List installed plugin types and their config options.")
    _add_json(p)


def add_schema(sub: Subparsers) -> None:
    p = _add(
        sub, "schema", cmd_schema, "Write the pipeline JSON Schema (installed plugins included)."
    )
    p.add_argument(
        "--output", "-o", metavar="DIR", help=f"write DIR/{SCHEMA_FILE} instead of printing"
    )


def add_export(sub: Subparsers) -> None:
    p = _add(sub, "export", cmd_export, "Print the JSON for vLLM's --kv-transfer-config.")
    p.add_argument("file", metavar="FILE")
    p.add_argument(
        "--reference",
        action="store_true",
        help="point vLLM at the file's absolute path instead of inlining the pipeline",
    )
    _add_kv_role(p, "the engine plays (its kv_role)")


def add_serve(sub: Subparsers) -> None:
    p = _add(sub, "serve", cmd_serve, "Run `vllm serve` with this pipeline as its KV connector.")
    p.add_argument("file", metavar="FILE")
    _add_kv_role(p, "this server plays (its kv_role)")
    p.add_argument(
        "--valkey",
        action="store_true",
        help="also start a local valkey-server (loopback, a free port; stopped when the server "
        "exits) and set VALKEY_HOST / VALKEY_PORT for the pipeline file, e.g. "
        "port: ${VALKEY_PORT}",
    )
    p.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="arguments for `vllm serve`, after --, e.g. -- MODEL --max-model-len 512",
    )


def add_simulate(sub: Subparsers) -> None:
    p = _add(
        sub,
        "simulate",
        cmd_simulate,
        "Predict each node's hit rate on a request trace (no engine; torch and vLLM not needed).",
    )
    p.epilog = (
        "Semantics: requests replay in trace order, one at a time. A request's hit is its "
        "longest run of leading blocks present in the serving tier, counted after vLLM's own "
        "prefix-cache hit (--vllm-cache-blocks); only full blocks are cached; at least one "
        "prompt token is always computed; nodes are asked in load_order and load_policy picks "
        "the server; a tier stores a request's blocks, by its save policy, when the request "
        "finishes. Trace: Mooncake JSONL, one hash id per 512 prompt tokens; the partial last "
        "block and the output are unique to their request. Nodes whose plugin has no model are "
        "shown as not modelled and never hit."
    )
    p.add_argument("file", metavar="PIPELINE")
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format JSONL trace")
    _add_simulate_size_options(p)
    add_fleet_options(p)
    p.add_argument(
        "--vllm-cache-blocks", type=int, default=0, metavar="N",
        help="model vLLM's own prefix cache of N blocks as a first tier (default 0: none)",
    )
    p.add_argument(
        "--exact", action="store_true",
        help="replay every vLLM block; by default, when the block size divides a trace "
        "block, whole trace blocks move as one unit (much faster; see docs/simulate.md)",
    )
    p.add_argument(
        "--sweep", metavar="FIELD=V1,V2,...",
        help="run once per value of a config field of every modelled node, e.g. "
        "capacity=1GiB,4GiB,16GiB, or of load_policy (load_policy=longest_hit,ranges), or "
        "with --fleet of engines (engines=4,8) or of the arrival rate (rate=2,4,8 requests "
        "a second): a table and a PNG plot",
    )
    p.add_argument(
        "--output", "-o", metavar="FILE",
        help="write the report to FILE; a sweep's plot goes to FILE with suffix .png "
        "(default kvc-simulate-sweep.png)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 if a cache policy raised "
                   "and was switched off (the report says so, and is written all the same)")
    _add_json(p)


def _add_simulate_size_options(p: argparse.ArgumentParser) -> None:
    """How big a block is, in bytes and in tokens (vLLM's and the trace's)."""
    p.add_argument(
        "--bytes-per-block", metavar="SIZE",
        help="bytes of one KV block, all layers (e.g. 2MiB)",
    )
    p.add_argument(
        "--model-config", metavar="CONFIG_JSON",
        help="a Hugging Face config.json (or its model directory): its KV cache groups as vLLM "
        "forms them; one group: bytes per block = layers x 2 x kv_heads x head_dim x dtype "
        "bytes x block size; a hybrid model's tier stores each layout's blocks on its own "
        "(sliding windows only what a hit needs; mamba groups: no hits)",
    )
    p.add_argument(
        "--block-size", type=int, default=32,
        help="vLLM's block size in tokens (default 32, as vLLM's CPU backend needs a "
        "multiple of 32; vLLM's GPU default is 16)",
    )
    p.add_argument(
        "--trace-block-tokens", type=int, default=512,
        help="tokens one trace hash id stands for (default 512, the trace's own); fewer "
        "rescales every length by the same factor, like a scaled replay",
    )


def add_trace(sub: Subparsers) -> None:
    p = _add(sub, "trace", _no_command, "Request traces for kvc simulate and kvc bench.")
    commands = p.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)
    g = commands.add_parser(
        "generate",
        help="write a seeded synthetic trace: tenants, agent sessions, long contexts",
        description="Write a seeded synthetic trace in the Mooncake format (a tenant a line): "
        "agent and chat sessions whose turns repeat their prompts (docs/simulate.md).",
    )
    g.set_defaults(func=cmd_trace_generate)
    g.add_argument("output", metavar="FILE", help="the JSONL trace to write")
    for flag, kind, text in _GENERATE_OPTIONS:
        g.add_argument(flag, type=kind, help=text)


#: ``kvc trace generate``'s shape options (composer.simulate.generate.TraceShape's fields).
_GENERATE_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("--requests", int, "requests to write (default 2000)"),
    ("--tenants", int, "tenants, the first busiest (default 8)"),
    ("--session-rate", float, "new sessions a second (default 2)"),
    ("--agent-share", float, "share of sessions that are agents (default 0.5)"),
    ("--system-tokens", int, "each tenant's shared system prompt (default 1024)"),
    ("--context-tokens", int, "a session's own first context, on average (default 4096)"),
    ("--max-context-tokens", int, "a session ends before its prompt passes this (default 131072)"),
    ("--decode-s", float, "seconds an answer takes per output token (default 0.02)"),
    ("--seed", int, "the random draws (default 0)"),
)


def _no_command(args: argparse.Namespace) -> int:  # pragma: no cover - argparse requires one
    return 2


def add_bench(sub: Subparsers) -> None:
    p = _add(
        sub,
        "bench",
        cmd_bench,
        "Replay a request trace against real vLLM servers: TTFT, latency, throughput, "
        "prompt tokens served per node, for several configurations side by side.",
    )
    p.epilog = (
        "Each hash id of the trace becomes a fixed block of 512/--scale token ids (the same id "
        "always the same tokens); the partial last block is unique to its request, as in kvc "
        "simulate --trace-block-tokens 512/SCALE. Configurations: 'none' (no connector, no "
        "prefix cache), 'prefix' (vLLM's prefix cache only), or a pipeline file (kvc serve, "
        "prefix cache on unless --pipeline-prefix-cache off). Writes OUTPUT/bench.md, "
        "OUTPUT/bench.json and OUTPUT/ttft-cdf.png."
    )
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format JSONL trace")
    p.add_argument(
        "--config", action="append", metavar="CONFIG",
        help="none, prefix or a pipeline file; repeat for several (default: none and prefix)",
    )
    p.add_argument("--model", help="model for the servers this command starts")
    p.add_argument("--url", help="a running server to target instead (one configuration)")
    p.add_argument(
        "--scale", type=int, default=16,
        help="divide every length by this (512 tokens per hash id become 512/SCALE; default 16)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--concurrency", type=int, metavar="N",
        help="keep N requests in flight, in trace order (default: the trace's arrival times)",
    )
    group.add_argument(
        "--speedup", type=float, default=1.0,
        help="send at the trace's arrival times divided by this (default 1)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="the first N requests of the trace")
    p.add_argument(
        "--max-output-tokens", type=int, metavar="N", help="cap every request's output"
    )
    _add_bench_server_options(p)
    _add_bench_run_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    _add_json(p)


def _add_bench_run_options(p: argparse.ArgumentParser) -> None:
    """How ``kvc bench`` runs its configurations: where results go, rounds, a fleet."""
    p.add_argument(
        "--output", "-o", default="kvc-bench", metavar="DIR",
        help="directory for the table, the JSON and the plot (default kvc-bench)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, metavar="N",
        help="run the configurations N times in alternating order (ABC, CBA, ...) and pool "
        "each one's requests, so that a machine's drifting load favours none (default 1)",
    )
    p.add_argument(
        "--fleet", type=int, metavar="N",
        help="start N engines running the one --config pipeline, each with vLLM's KV event "
        "publisher, behind vLLM's router (vllm-router), and replay the trace once per --policy; "
        "the table has a row per policy",
    )
    p.add_argument(
        "--warm-up", type=int, default=0, metavar="PASSES",
        help="with --fleet: replay the trace PASSES times through the fleet (round_robin) "
        "before measuring, its caches emptied after: an engine's first passes run slower "
        "(default 0)",
    )
    p.add_argument(
        "--pd", action="store_true",
        help="start a prefill and a decode engine running the one --config pipeline (with a "
        "transport node, e.g. NIXL) behind vLLM's router in its P/D mode, and replay the "
        "trace through it and through the router over the same engines without P/D; the "
        "table has TTFT, tokens served per node on each engine and bytes over NIXL",
    )
    p.add_argument(
        "--policy", action="append", metavar="POLICY",
        help="with --fleet: round_robin, consistent_hash, cache_aware, kv_aware-vllm (the "
        "router credits only vLLM's own events) or kv_aware-tiers (the tiers' events too), "
        "a kv_aware one with vllm-router's settings after a colon (kv_aware-tiers:external=1,"
        "affinity=600; docs/fleet.md); repeat for several (default: all five). With --pd: "
        "the policy without P/D "
        "(default cache_aware)",
    )


def _add_bench_server_options(p: argparse.ArgumentParser) -> None:
    """The options of the servers ``kvc bench`` starts (in the help, between the
    workload's options and the output's)."""
    p.add_argument("--block-size", type=int, default=32, help="vLLM's block size (default 32)")
    p.add_argument(
        "--max-model-len", type=int, default=4096,
        help="vLLM's max model length; longer requests are skipped and counted (default 4096)",
    )
    p.add_argument(
        "--num-gpu-blocks", type=int, metavar="N",
        help="size vLLM's own KV cache to N blocks (--num-gpu-blocks-override), so that it "
        "overflows",
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=1,
        help="VLLM_CPU_KVCACHE_SPACE for the servers (default 1)",
    )
    p.add_argument(
        "--pipeline-prefix-cache", choices=("on", "off"), default="on",
        help="vLLM's prefix cache with pipeline configurations (default on)",
    )
    p.add_argument(
        "--vllm-arg", action="append", metavar="ARG",
        help="one more argument for every vllm serve (repeat; e.g. --vllm-arg=--enforce-eager)",
    )
    p.add_argument(
        "--vocab-size", type=int,
        help="token ids to draw from (default: the model directory's config.json)",
    )


def add_top(sub: Subparsers) -> None:
    p = _add(
        sub,
        "top",
        cmd_top,
        "Live view of a running server's KV Composer nodes (hits, hit rate, bytes/s, pool use).",
    )
    p.add_argument("url", metavar="URL", help="the server's base URL or its /metrics URL")
    p.add_argument(
        "--interval", type=float, default=2.0, help="seconds between scrapes (default 2)"
    )
    p.add_argument(
        "--once", action="store_true",
        help="print one view (two scrapes INTERVAL apart, for the rates) and exit",
    )


def add_demo(sub: Subparsers) -> None:
    p = _add(sub, "demo", cmd_demo, "Serve a tiny local model through a composed pipeline.")
    p.add_argument("file", nargs="?", metavar="FILE", help="pipeline to use (default: built in)")


COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    add_validate,
    add_graph,
    add_plugins,
    add_schema,
    add_export,
    add_serve,
    add_simulate,
    add_calibrate,
    add_trace,
    add_bench,
    add_top,
    add_demo,
)
