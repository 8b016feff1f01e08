"""Test-only plugins loaded into vLLM's processes via $KV_COMPOSER_PLUGIN_MODULES.

``offload-cpu-corruptor`` needs an ``offload-cpu`` node and, on the worker,
flips one byte of every ``every``-th slot that node has finished saving (host
memory gone bad). It records how many loads the node then refused into a JSON file.

``offload-cpu-holdings`` needs an ``offload-cpu`` node and, in the scheduler,
records each request's vLLM block hashes at its first lookup; at the first
lookup of request ``dump_at`` it writes what the tier holds (the hashes it
announced) and, for every request recorded, how many leading blocks the tier
would serve: the truth a router's index built from the events must match.
"""

from __future__ import annotations

import json
from typing import Any

from offload_cpu_fakes import corrupt
from pydantic import BaseModel, ConfigDict

from composer import (
    Capabilities,
    Plugin,
    PluginType,
    hookimpl,
    kv_transfer_config,
    load_pipeline,
)


def tier_pipeline(
    config: dict[str, Any], extra_nodes: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """The engine tests' ``kv_transfer_config``: one ``cpu`` offload-cpu node, plus
    others; ``fields``: more top-level pipeline fields."""
    nodes = {"cpu": {"plugin": "offload-cpu", "on_error": "recompute", "config": config}}
    nodes.update(extra_nodes or {})
    return kv_transfer_config(load_pipeline({"version": 1, "nodes": nodes, **fields}))


class CorruptorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str
    report: str
    every: int = 1


class Corruptor(Plugin[CorruptorConfig]):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.done: set[tuple[int, int]] = set()
        self.report = {"corrupted": 0, "load_failures": 0, "loads_ok": 0}

    def _half(self) -> Any:
        """The target node's worker half (its service is the node itself)."""
        return self.ctx.needs.get(self.config.target)

    @hookimpl
    def bind_connector_metadata(self, metadata: Any) -> None:
        half = self._half()
        if half is None or half.pool is None:
            return
        # (slot, generation) of every slot holding a finished save (-1: being written).
        saved = [(slot, gen) for slot, gen in enumerate(half._slot_gen) if gen > 0]
        for slot, gen in saved:
            if slot % self.config.every == 0 and (slot, gen) not in self.done:
                corrupt(half.pool, slot, 7)
                self.done.add((slot, gen))
                self.report["corrupted"] += 1
        self._write(half)

    @hookimpl
    def shutdown(self) -> None:
        half = self._half()
        if half is not None:
            self._write(half)

    def _write(self, half: Any) -> None:
        # The target's own public counters: loads refused (checksum) and served.
        self.report["load_failures"] = half.blocks_refused
        self.report["loads_ok"] = half.blocks_loaded
        with open(self.config.report, "w") as f:
            json.dump(self.report, f)


class HoldingsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str
    report: str
    dump_at: int


class Holdings(Plugin[HoldingsConfig]):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.requests: list[Any] = []

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:
        import time

        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        if any(r.request_id == request.request_id for r in self.requests):
            return 0, False
        self.requests.append(request)
        if len(self.requests) != self.config.dump_at:
            return 0, False
        tier = self.ctx.needs[self.config.target]
        # A ready entry's event: what its groups' BlockStored announced, (hash, group) each.
        held = [h for e in tier.index.entries() if e.ready and e.event for h, _ in e.event]
        report = {
            "at": time.time(),
            "held": held,
            "block_size": tier.block_size,
            "prompts": [
                {
                    "tokens": r.num_tokens,
                    "hashes": [maybe_convert_block_hash(h) for h in r.block_hashes],
                    # The tier's own answer, asked as vLLM would (nothing computed yet).
                    "blocks": tier.get_num_new_matched_tokens(r, 0)[0] // tier.block_size,
                }
                for r in self.requests[: self.config.dump_at - 1]
            ],
        }
        with open(self.config.report, "w") as f:
            json.dump(report, f)
        return 0, False


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="offload-cpu-corruptor",
            worker=Corruptor,
            config=CorruptorConfig,
            description="test only: corrupts an offload-cpu node's host pool",
            # Touches no KV cache group itself: vLLM's hybrid manager stays on.
            capabilities=Capabilities(hma=True),
        )
    )
    register(
        PluginType(
            name="offload-cpu-holdings",
            scheduler=Holdings,
            config=HoldingsConfig,
            description="test only: what an offload-cpu node holds, for the events test",
            default_role="load",
            roles=frozenset({"load"}),
            capabilities=Capabilities(hma=True),
        )
    )
