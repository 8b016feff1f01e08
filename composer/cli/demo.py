"""``kvc demo``: real vLLM serving through a composed pipeline on a tiny local model.

Runs the same requests twice, in two engine processes with the same CPU thread
settings: once without any connector (the reference) and once through the
pipeline, with vLLM's own prefix cache off so every hit comes from the
pipeline. Prints, per request (named for its part in the story: a prompt's
first time, the same prompt again, a prompt that starts as another does), the
prompt tokens, which node served how many tokens, the time to first token,
and whether the output equals the reference.
"""

from __future__ import annotations

import sys
from typing import Any

from composer.errors import PipelineInvalid
from composer.export import kv_transfer_config
from composer.testing.engine import EngineFailed, EngineSpec, run_engine
from composer.testing.tiny_model import build_tiny_model, make_prompts
from composer.validation import load_pipeline

DEFAULT_PIPELINE: dict[str, Any] = {
    "version": 1,
    "nodes": {
        "cpu": {
            "plugin": "offload-cpu",
            "on_error": "recompute",
            "config": {"capacity": "256MiB", "checksums": True},
        }
    },
}


def demo_rounds() -> list[list[tuple[str, str]]]:
    """The requests, round by round, as ``(name, prompt)``; round 2 starts when round 1
    has finished. Round 1: three new prompts. Round 2: two of them again, one that
    starts as A does, and a new one."""

    a, b, c, d, tail = make_prompts(5, words=90, seed=11)
    a_start = " ".join(a.split()[:60] + tail.split()[:30])
    return [
        [("A, first time", a), ("B, first time", b), ("C, first time", c)],
        [("A again", a), ("B again", b), ("A's start, new end", a_start), ("D, first time", d)],
    ]


def main(file: str | None = None, *, max_tokens: int = 16) -> int:
    try:
        pipeline = load_pipeline(file if file else DEFAULT_PIPELINE)
    except PipelineInvalid as exc:
        print(exc, file=sys.stderr)
        return 2
    source = {**pipeline.source, "annotate_outputs": True}
    config = kv_transfer_config(load_pipeline(source))
    print(f"pipeline: {file or 'built-in demo pipeline (offload-cpu)'}")
    print(f"nodes: {', '.join(f'{n.id} ({n.plugin.name})' for n in pipeline.nodes)}")
    print("building the tiny local model (random weights, local tokenizer)...", flush=True)
    model = str(build_tiny_model())
    named_rounds = demo_rounds()
    rounds = [[prompt for _, prompt in requests] for requests in named_rounds]
    try:
        # Both engines eager (no torch.compile warm-up): each starts seconds sooner,
        # and the two sides of the comparison agree on it. The reference runs vLLM's
        # engine core and worker in one process (it has no connector, whose metadata
        # the served pipeline carries between them): it starts in a third of the
        # time, with the same OpenMP threads as the pipeline's engine.
        print("running vLLM without a connector (reference)...", flush=True)
        reference = run_engine(
            EngineSpec(
                model=model, rounds=rounds, max_tokens=max_tokens, enforce_eager=True,
                in_process=True,
            )
        )
        print("running vLLM through the pipeline...", flush=True)
        composed = run_engine(
            EngineSpec(
                model=model, rounds=rounds, max_tokens=max_tokens, kv_transfer_config=config,
                enforce_eager=True,
            )
        )
    except EngineFailed as exc:
        print(exc, file=sys.stderr)
        return 1

    return _report(named_rounds, reference.rounds, composed.rounds)


def _report(named_rounds: list[list[tuple[str, str]]], reference: Any, composed: Any) -> int:
    """The table of every request: what served it, and whether its output is the
    reference's; 0 when every one is and the pipeline served some."""
    print()
    width = max(len(name) for requests in named_rounds for name, _ in requests)
    columns = f"{'request':<{width}} {'prompt':>6}  {'served by':<18} {'ttft ms':>8}  same output"
    header = f"{'round':>5}  {columns}"
    print(header)
    print("-" * len(header))
    all_same = True
    hits = 0
    for r, (requests, ref_round, got_round) in enumerate(
        zip(named_rounds, reference, composed, strict=True)
    ):
        for (name, _), ref, got in zip(requests, ref_round, got_round, strict=True):
            info = (got.kv_transfer_params or {}).get("kv_composer") or {}
            served = f"{info['served_by']}: {info['tokens']} tok" if info.get("served_by") else "-"
            hits += info.get("tokens", 0)
            same = ref.tokens == got.tokens
            all_same &= same
            ttft = f"{got.ttft_s * 1000:8.1f}" if got.ttft_s else "       -"
            print(
                f"{r + 1:>5}  {name:<{width}} {got.prompt_tokens:>6}  {served:<18} {ttft}  "
                f"{'yes' if same else 'NO'}"
            )
    print()
    print(f"tokens served by the pipeline: {hits}; every output equals the reference: {all_same}")
    return 0 if all_same and hits > 0 else 1
