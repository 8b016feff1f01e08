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

from composer import Capabilities, PluginType, hookimpl
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
