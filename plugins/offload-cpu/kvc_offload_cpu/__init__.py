"""KV Composer ``offload-cpu`` plugin: a CPU memory tier for vLLM KV cache blocks.

Importing this package is light (no torch): the node's two halves,
:mod:`kvc_offload_cpu.scheduler` (the block index, in vLLM's scheduler) and
:mod:`kvc_offload_cpu.worker` (the host pool and the copies, with torch, in
each worker), are named as ``"module:Class"`` by
:mod:`kvc_offload_cpu.registration` and imported by KV Composer only when a
pipeline actually runs.
"""

from kvc_offload_cpu.config import OffloadCPUConfig

__all__ = ["OffloadCPUConfig"]
__version__ = "0.1.0"
