"""What an offload-cpu node serves of a model's KV cache groups (``kvc validate --model``).

Light on purpose: it reads the predicted groups only.
"""

from __future__ import annotations

from pydantic import BaseModel

from composer import ModelKV


def model_support(config: BaseModel, model: ModelKV) -> str:
    if "mamba" in model.kinds:
        # A hit needs the mamba state at the hit point, and vLLM CPU 0.32 keeps no
        # per-block state snapshots (mamba_cache_mode='none') to restore one from.
        return (
            f"serves no hits for {model.label} ({model.kinds_label}): vLLM CPU 0.32 keeps no "
            "per-block mamba state snapshots to restore; the engine runs, every token is computed"
        )
    served = []
    for kind in model.kinds:
        if kind == "attention":
            served.append("attention (whole blocks)")
        else:
            served.append(f"{kind} (the blocks inside the window before a hit)")
    return "serves " + ", ".join(served)
