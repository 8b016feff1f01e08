"""What an lmcache node serves of a model's KV cache groups (``kvc validate --model``).

Light on purpose: it reads the node's config and the predicted groups only.
"""

from __future__ import annotations

from pydantic import BaseModel

from composer import ModelKV, ModelUnsupported
from kvc_lmcache.config import LMCacheConfig

LMCACHE = "LMCache 0.5.6"


def model_support(config: BaseModel, model: ModelKV) -> str:
    assert isinstance(config, LMCacheConfig)
    if "mamba" in model.kinds:
        # LMCache's connector asks vLLM for per-block mamba states; vLLM CPU runs
        # mamba_cache_mode='none', which LMCache refuses at start.
        raise ModelUnsupported(
            f"{LMCACHE} cannot serve {model.label}: it has a mamba group "
            f"({model.kinds_label}) and LMCache refuses vLLM's mamba_cache_mode='none'; "
            "serve it with offload-cpu, or without this node"
        )
    if config.mode == "in_process" and config.kv_cache_group is not None:
        index = config.kv_cache_group
        if index >= len(model.groups):
            raise ModelUnsupported(
                f"kv_cache_group: {index}, but {model.label} has {len(model.groups)} KV cache "
                f"group(s) ({model.kinds_label}); choose 0 to {len(model.groups) - 1}"
            )
        group = model.groups[index]
        if group.kind != "attention":
            raise ModelUnsupported(
                f"kv_cache_group: {index} is a {group.kind} group of {model.label}; "
                "LMCache handles full-attention groups only: choose one of those"
            )
        return f"serves KV cache group {index} (attention, {group.layers} layers) only"
    if len(model.groups) > 1:
        connector = "connector" if config.mode == "server" else "in-process connector"
        raise ModelUnsupported(
            f"{LMCACHE}'s {connector} handles one KV cache group; {model.label} has "
            f"{model.kinds_label} groups: serve it with offload-cpu, or set `hma: off` in the "
            "pipeline (vLLM then runs one group; sliding layers keep the whole context)"
        )
    return "serves the model's one KV cache group (whole blocks, in chunks)"
