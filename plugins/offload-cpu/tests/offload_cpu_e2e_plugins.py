"""A test-only plugin loaded into vLLM's processes via $KV_COMPOSER_PLUGIN_MODULES.

``offload-cpu-corruptor`` needs an ``offload-cpu`` node and, on the worker,
flips one byte of every ``every``-th slot that node has finished saving (host
memory gone bad). It records how many loads the node then refused into a JSON file.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from composer import Plugin, PluginType, hookimpl


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
        self.hooked = False

    def _half(self) -> Any:
        """The target node's worker half (its service is the node itself)."""
        return self.ctx.needs.get(self.config.target)

    @hookimpl
    def bind_connector_metadata(self, metadata: Any) -> None:
        half = self._half()
        if half is None or half.pool is None:
            return
        if not self.hooked:
            self._count_loads(half)
        changed = False
        for slot, gen in enumerate(half._slot_gen):
            if gen > 0 and slot % self.config.every == 0 and (slot, gen) not in self.done:
                half.pool.corrupt(slot, 7)
                self.done.add((slot, gen))
                self.report["corrupted"] += 1
                changed = True
        if changed:
            self._write()

    def _count_loads(self, half: Any) -> None:
        finish = half._finish_load

        def counting(result: Any) -> None:
            finish(result)
            self.report["load_failures"] += sum(not ok for ok in result.ok)
            self.report["loads_ok"] += sum(bool(ok) for ok in result.ok)
            self._write()

        half._finish_load = counting
        self.hooked = True

    def _write(self) -> None:
        with open(self.config.report, "w") as f:
            json.dump(self.report, f)


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="offload-cpu-corruptor",
            worker=Corruptor,
            config=CorruptorConfig,
            description="test only: corrupts an offload-cpu node's host pool",
        )
    )
