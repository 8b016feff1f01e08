"""A stand-in for vLLM's CUDA platform, for running the Python of vLLM's GPU
release (PyPI's ``vllm`` wheel) on a machine with no GPU, in tests only.

Why: that wheel's Python imports and runs here with the CPU torch (connector
classes, the connector factory, config checks, the scheduler), but vLLM finds
no device and takes ``UnspecifiedPlatform``, which answers differently from the
platform the release is built for in ways that change what the tests see:

* ``support_hybrid_kv_cache()`` is False, so every ``VllmConfig`` turns the
  hybrid KV cache manager (HMA) off before any connector is asked, and what a
  connector answers about HMA is never tested;
* ``device_type`` is empty, so ``DeviceConfig(device="auto")`` fails with
  "Failed to infer device type": it is the default of every ``VllmConfig``
  (the dispatch benchmark's among them), and ``vllm serve``'s argument parser
  builds it for the defaults it shows (``kvc serve``, ``vllm serve --help``).

What it answers, as ``vllm.platforms.cuda.CudaPlatformBase`` does:
``support_hybrid_kv_cache()`` True; ``device_name`` and ``device_type``
``"cuda"``, ``dispatch_key`` ``"CUDA"``, ``ray_device_key`` ``"GPU"``,
``dist_backend`` ``"nccl"``, ``device_control_env_var``
``"CUDA_VISIBLE_DEVICES"``. Everything else is ``UnspecifiedPlatform``'s,
its ``PlatformEnum`` included: ``is_cuda()`` stays False, so vLLM takes none
of its CUDA-only paths (kernels, streams, device queries), which could not run
here. It cannot run an engine.

It is activated through vLLM's own out-of-tree platform mechanism, the
``vllm.platform_plugins`` entry point group: the suite's pass on vLLM's GPU
release puts ``tests/gpu_release/site/`` on ``PYTHONPATH``, whose
``kvc_gpu_platform_standin`` distribution declares :func:`activate` there, so
the stand-in is vLLM's ``current_platform`` in every process of that pass
(subprocesses included) and in no other.
"""

from __future__ import annotations

from vllm.platforms.interface import UnspecifiedPlatform


class CudaPlatformStandIn(UnspecifiedPlatform):
    device_name: str = "cuda"
    device_type: str = "cuda"
    dispatch_key: str = "CUDA"
    ray_device_key: str = "GPU"
    dist_backend: str = "nccl"
    device_control_env_var: str = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True


def activate() -> str:
    """vLLM's platform plugin hook: the platform class to use, by qualified name."""
    return f"{__name__}.{CudaPlatformStandIn.__qualname__}"
