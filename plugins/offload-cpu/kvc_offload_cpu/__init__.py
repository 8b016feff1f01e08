"""KV Composer ``offload-cpu`` plugin: a CPU memory tier for vLLM KV cache blocks.

Importing this package is light (no torch): the runtime node lives in
:mod:`kvc_offload_cpu.node` and is imported by KV Composer only when a
pipeline actually runs.
"""

from kvc_offload_cpu.config import OffloadCPUConfig

__all__ = ["OffloadCPUConfig"]
__version__ = "0.1.0"
