"""Test plugins, registered in vLLM's processes through $KV_COMPOSER_PLUGIN_MODULES.

* ``probe`` records what the adapter hands a node (the model, the canonical KV
  view, checked byte for byte against vLLM's tensors) into a JSON file.
* ``faulty`` claims a hit on every prompt and then fails the load: by raising
  (``mode: raise``) or, to show that the identical-output check can fail, by
  loading noise into the blocks it claimed (``mode: noise``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from composer import Capabilities, Plugin, PluginType, hookimpl


class ProbeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


class Probe(Plugin[ProbeConfig]):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.report: dict[str, Any] = {"role": ctx.process, "initialize_calls": 0}

    def _write(self) -> None:
        with open(f"{self.config.path}.{self.ctx.process}", "w") as f:
            json.dump(self.report, f)

    @hookimpl
    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        self.report["initialize_calls"] += 1
        self.report["model_class"] = type(model).__name__
        self.report["model_params"] = sum(p.numel() for p in model.parameters())
        self.report["num_blocks"] = kv_cache_config.num_blocks
        self._write()

    @hookimpl
    def register_kv_caches(self, kv_caches: Any, raw: dict[str, Any]) -> None:
        import torch

        checks = []
        for region in kv_caches.regions:
            for block in (0, 1, kv_caches.num_blocks - 1):
                row = region.tensor[block]
                # Write a pattern through the canonical row and read it back
                # through vLLM's own layer tensors.
                saved = row.clone()
                row.copy_(
                    torch.arange(row.numel(), dtype=torch.int64).remainder(127).to(torch.int8)
                )
                seen = b"".join(
                    raw[layer][block].contiguous().view(torch.int8).numpy().tobytes()
                    for layer in region.layers
                )
                checks.append(seen == row.numpy().tobytes())
                row.copy_(saved)
        self.report["canonical"] = {
            "regions": len(kv_caches.regions),
            "groups": [[g.kind, g.block_size, list(g.region_ids)] for g in kv_caches.groups],
            "bytes_per_block": kv_caches.bytes_per_block,
            "layers": sorted(layer for r in kv_caches.regions for layer in r.layers),
            "raw_layers": sorted(raw),
            "rows_match_vllm": all(checks) and bool(checks),
        }
        self._write()


class FaultyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["raise", "noise"] = "raise"
    block_size: int = 32


class Faulty(Plugin[FaultyConfig]):
    """Claims every full block but the last token's as a hit; then fails to load them."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.to_load: list[int] = []
        self.blocks: Any = None

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        bs = self.config.block_size
        claim = (len(request.prompt_token_ids) - 1) // bs * bs - num_computed_tokens
        return max(claim, 0), False

    @hookimpl
    def update_state_after_alloc(self, block_ids: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            n = num_external_tokens // self.config.block_size
            self.to_load.extend(block_ids[0][:n])

    @hookimpl
    def build_connector_meta(self) -> list[int]:
        blocks, self.to_load = self.to_load, []
        return blocks

    @hookimpl
    def bind_connector_metadata(self, metadata: list[int] | None) -> None:
        self.pending = metadata or []

    @hookimpl
    def register_kv_caches(self, kv_caches: Any) -> None:
        self.blocks = kv_caches

    @hookimpl
    def start_load_kv(self) -> None:
        if not self.pending:
            return
        if self.config.mode == "raise":
            raise RuntimeError(f"injected load failure for blocks {self.pending}")
        import torch

        ids = torch.tensor(self.pending, dtype=torch.long)
        for region in self.blocks.regions:
            noise = torch.randint(-20, 20, (len(ids), region.bytes_per_block), dtype=torch.int8)
            region.tensor[ids] = noise


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="probe",
            worker=Probe,  # the model exists in workers only
            config=ProbeConfig,
            roles={"service"},
            capabilities=Capabilities(needs_model=False),
        )
    )
    register(PluginType(name="faulty", node=Faulty, config=FaultyConfig))
