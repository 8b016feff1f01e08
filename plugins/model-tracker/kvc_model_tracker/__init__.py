"""KV Composer ``model-tracker`` plugin: the loaded vLLM model as a typed service.

Importing this package is light (no torch, no LMCache): the runtime node lives
in :mod:`kvc_model_tracker.node` and is imported only when a pipeline runs.
"""

from kvc_model_tracker.config import ModelTrackerConfig
from kvc_model_tracker.handle import ModelHandle, ModelNotTracked

__all__ = ["ModelHandle", "ModelNotTracked", "ModelTrackerConfig"]
__version__ = "0.1.0"
