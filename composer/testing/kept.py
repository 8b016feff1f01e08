"""A test node that tells each finished request how many of its prompt tokens vLLM kept
from outside: ``kv_transfer_params`` ``kept_tokens``, the fewest computed tokens vLLM
scheduled the request with.

vLLM counts a planned load as computed tokens when it schedules a request; when
blocks fail to load it truncates them at the first failed block and schedules
the request again from there. So with vLLM's prefix cache off and no
preemption, what a tier delivered is known without asking KV Composer, and a
test can hold ``served_by``/``tokens`` to it. Loaded into vLLM's processes as
the plugin module ``composer.testing.kept`` (``$KV_COMPOSER_PLUGIN_MODULES``),
node type ``kept-tokens``.
"""

from __future__ import annotations

from typing import Any

from composer import Capabilities, PluginType, hookimpl, scrape
from composer.plugin import Plugin

MODULE = "composer.testing.kept"


class KeptTokens(Plugin):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.kept: dict[str, int] = {}

    def _saw(self, request_id: str, computed: int) -> None:
        self.kept[request_id] = min(self.kept.get(request_id, computed), computed)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            self._saw(new.req_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for request_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._saw(request_id, computed)

    @hookimpl
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any]]:
        return False, {"kept_tokens": self.kept.pop(request.request_id, 0)}


def node() -> dict[str, Any]:
    """The node, for a test's pipeline."""
    return {"plugin": "kept-tokens"}


def reported_vs_kept(rounds: list[list[Any]]) -> tuple[list[tuple[Any, ...]], int]:
    """Requests (round, index, note, kept) whose ``kv_composer`` note differs from what
    vLLM kept, and how many requests' vLLM ``cached_tokens`` counted a failed load
    (each must then be kept + failed)."""
    wrong: list[tuple[Any, ...]] = []
    vllm_counts_failed = 0
    for r, rnd in enumerate(rounds):
        for i, x in enumerate(rnd):
            params = x.kv_transfer_params or {}
            note, kept = params["kv_composer"], params["kept_tokens"]
            if note["tokens"] != kept or (note["served_by"] is None) != (kept == 0):
                wrong.append((r, i, note, kept))
            if x.cached_tokens != kept:
                vllm_counts_failed += 1
                failed = note.get("failed") or []
                # (one dict for one node's load; a list for ranges)
                lost = sum(f["tokens"] for f in (failed if isinstance(failed, list) else [failed]))
                if x.cached_tokens != kept + lost:
                    wrong.append((r, i, note, kept, f"vLLM cached_tokens {x.cached_tokens}"))
    return wrong, vllm_counts_failed


#: Per-node counters a request's note settles: on ``/metrics``, against the notes.
SETTLED = ("requests_hit", "prompt_tokens_hit", "tokens_hit", "loads_failed", "tokens_load_failed")


def counted_vs_reported(rounds: list[list[Any]], metrics: str) -> dict[str, Any]:
    """Nodes whose ``/metrics`` counters (:data:`SETTLED`, from the engine's
    ``metrics``) differ from the sum of what the requests' notes say each
    served and lost: node -> (counted, reported). Empty when they agree."""
    reported: dict[str, dict[str, float]] = {}

    def add(node: str, key: str, amount: float) -> None:
        counts = reported.setdefault(node, dict.fromkeys(SETTLED, 0.0))
        counts[key] += amount

    for rnd in rounds:
        for x in rnd:
            note = (x.kv_transfer_params or {})["kv_composer"]
            served = note.get("ranges")
            if served is None:  # one node's load
                served = [{"node": note["served_by"], "tokens": note["tokens"]}]
            for part in served:
                if part["node"] and part["tokens"]:
                    add(part["node"], "requests_hit", 1)
                    add(part["node"], "prompt_tokens_hit", part["tokens"])
                    add(part["node"], "tokens_hit", part["tokens"])
            failed = note.get("failed") or []
            for part in failed if isinstance(failed, list) else [failed]:
                add(part["node"], "loads_failed", 1)
                add(part["node"], "tokens_load_failed", part["tokens"])
    views = scrape.nodes(scrape.parse(metrics))
    wrong: dict[str, Any] = {}
    for node in sorted(set(reported) | set(views)):
        view = views.get(node)
        counted = {
            key: (view.counters.get(key) or view.events.get(key) or 0.0) if view else 0.0
            for key in SETTLED
        }
        want = reported.get(node, dict.fromkeys(SETTLED, 0.0))
        if counted != want:
            wrong[node] = (counted, want)
    return wrong


@hookimpl
def register_plugin_types(register: Any) -> None:
    # A service (no loads, no saves), of any model: hybrid ones keep vLLM's hybrid manager.
    register(
        PluginType(
            name="kept-tokens",
            scheduler=KeptTokens,
            roles={"service"},
            capabilities=Capabilities(hma=True),
        )
    )
