"""The ``model-tracker`` node's options (validated before vLLM starts)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: The instance id LMCache's vLLM integration looks the model up under.
LMCACHE_ENGINE_ID = "vllm-instance"


class ModelTrackerConfig(BaseModel):
    """Receives vLLM's loaded model once per worker and offers it to dependent nodes."""

    model_config = ConfigDict(extra="forbid")

    lmcache: Literal["auto", "always", "never"] = Field(
        default="auto",
        description=(
            "Register the model with LMCache's VLLMModelTracker: auto = when LMCache is "
            "installed, always = fail at start-up if it is not, never = do not."
        ),
    )
    lmcache_instance_id: str = Field(
        default=LMCACHE_ENGINE_ID,
        min_length=1,
        description="Instance id the model is registered under in LMCache (its engine id).",
    )
    report_file: str | None = Field(
        default=None,
        description=(
            "Write a JSON summary of the tracked model (and the LMCache registration) to "
            "this path, suffixed with the worker rank; for tests and debugging."
        ),
    )
