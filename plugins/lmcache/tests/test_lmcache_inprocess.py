"""lmcache in-process mode against LMCache's real ``LMCacheConnectorV1Impl``.

LMCache's in-process engine needs CUDA/XPU, so the factory its
``LMCacheManager`` builds the engine and lookup client with is a stand-in for
those parts (:mod:`lmcache_standins`); everything else is LMCache's and vLLM's
own code: the impl and its manager, its config loading from the parent's
``lmcache.*`` extra config, vLLM's ``KVTransferConfig``, ``KVCacheConfig`` and
``Request`` classes, and KV Composer's chain. The answers of LMCache's lookups
are ``test_lmcache_contract``'s.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
import pytest
import torch  # noqa: E402
import vllm  # noqa: F401  (installed by `make test`: missing must fail, not skip)
from kvc_lmcache import memory  # noqa: E402
from kvc_lmcache.inprocess import InvalidKVCacheGroup, LMCacheInProcessNode  # noqa: E402
from lmcache.integration.vllm import vllm_v1_adapter  # noqa: E402
from lmcache_standins import BLOCK, StandInLookup, request, stand_in, vllm_config
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from composer import load_pipeline  # noqa: E402
from composer.testing.chains import chain_for  # noqa: E402


@pytest.fixture(autouse=True)
def no_cuda_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, StandInLookup(hits=0))
    # Without the engine no CPU buffer is allocated: the nodes here start on any
    # machine, whatever its memory (the check has its own tests, at the end).
    monkeypatch.setattr(memory, "available_memory", lambda: (2**60, 2**60))


def hybrid_kv_cache_config() -> KVCacheConfig:
    common: dict[str, Any] = dict(
        block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layers.0"], SlidingWindowSpec(sliding_window=32, **common)),
            KVCacheGroupSpec(["layers.1"], FullAttentionSpec(**common)),
        ],
    )


def pipeline(config: dict[str, Any]) -> Any:
    return load_pipeline({"version": 1, "nodes": {"lm": {"plugin": "lmcache", "config": config}}})


def chain(role: Any, config: dict[str, Any]) -> Any:
    return chain_for(
        pipeline({"mode": "in_process", **config}),
        role,
        vllm_config=vllm_config(),
        kv_cache_config=hybrid_kv_cache_config(),
    )


def test_node_options_reach_lmcaches_own_config() -> None:
    node = chain(
        "worker", {"chunk_size": 64, "max_local_cpu_size": 2.5, "extra": {"min_retrieve_tokens": 7}}
    ).nodes["lm"]
    assert isinstance(node, LMCacheInProcessNode)
    assert isinstance(node.impl, vllm_v1_adapter.LMCacheConnectorV1Impl)
    config = node.impl.config
    assert (config.chunk_size, config.max_local_cpu_size, config.min_retrieve_tokens) == (
        64,
        2.5,
        7,
    )
    assert node.impl._parent is node.parent and node.parent.impl is node.impl


def test_a_group_that_does_not_exist() -> None:
    with pytest.raises(InvalidKVCacheGroup) as err:
        chain("scheduler", {"kv_cache_group": 3})
    assert str(err.value) == (
        "lmcache: kv_cache_group 3 does not exist; this model's KV cache groups are "
        "0: SlidingWindowSpec, 1: FullAttentionSpec"
    )


def test_a_group_that_is_not_full_attention() -> None:
    with pytest.raises(InvalidKVCacheGroup) as err:
        chain("worker", {"kv_cache_group": 0})
    assert str(err.value) == (
        "lmcache: kv_cache_group 0 is SlidingWindowSpec, not full attention; LMCache handles "
        "a full-attention group: [1] (groups: 0: SlidingWindowSpec, 1: FullAttentionSpec)"
    )


def test_request_finished_all_groups_forwards_the_selected_group() -> None:
    c = chain("scheduler", {"kv_cache_group": 1})
    assert c.pipeline.hma
    node = c.nodes["lm"]
    seen: list[list[int]] = []
    real = node.impl.request_finished

    def recording(request: Any, block_ids: list[int]) -> Any:
        seen.append(block_ids)
        return real(request, block_ids)  # LMCache's own code runs

    node.impl.request_finished = recording
    r = request("r1", 3)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = c.request_finished_all_groups(r, ([1, 2], [7, 8, 9]))
    assert seen == [[7, 8, 9]]
    assert hold is False and params is None


def test_scheduler_output_is_narrowed_to_the_selected_group() -> None:
    c = chain("scheduler", {"kv_cache_group": 1})
    node = c.nodes["lm"]
    seen: list[Any] = []

    def build(so: Any) -> str:
        seen.append(so)
        return "meta"

    node.impl.build_connector_meta = build
    new = SimpleNamespace(req_id="r1", block_ids=([1, 2], [5, 6]), sampling_params=None)
    cached = SimpleNamespace(req_ids=["r0"], new_block_ids=[([3], [9])])
    output = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
        finished_req_ids=set(),
    )
    meta = c.build_connector_meta(output)
    assert meta.per_node == {"lm": "meta"}
    (view,) = seen
    assert view.scheduled_new_reqs[0].block_ids == ([5, 6],)
    assert view.scheduled_cached_reqs.new_block_ids == [([9],)]
    # vLLM's own objects are untouched.
    assert new.block_ids == ([1, 2], [5, 6]) and cached.new_block_ids == [([3], [9])]


def test_only_the_groups_layers_are_registered() -> None:
    node = chain("worker", {"kv_cache_group": 1}).nodes["lm"]
    seen: list[dict[str, Any]] = []
    node.impl.register_kv_caches = seen.append
    caches = {"layers.0": torch.zeros(1), "layers.1": torch.zeros(2)}
    node.register_kv_caches(raw=caches)
    assert list(seen[0]) == ["layers.1"]


def test_blending_requires_the_model_under_lmcaches_engine_name() -> None:
    from kvc_model_tracker import ModelHandle
    from kvc_model_tracker.handle import ModelSummary

    ctx_chain = chain("worker", {})
    node = ctx_chain.nodes["lm"]
    node.config = node.config.model_copy(update={"enable_blending": True})
    handle = ModelHandle("tracker")
    node.ctx.needs = {"tracker": handle}
    with pytest.raises(Exception, match='model-tracker node "tracker" has no model'):
        node.initialize_worker_connector(None, None, None)
    handle.set(torch.nn.Linear(1, 1), ModelSummary("Linear", None, 2, "float32"))
    handle.lmcache_instance_id = "other"
    with pytest.raises(RuntimeError, match="looks the model up under 'vllm-instance'"):
        node.initialize_worker_connector(None, None, None)
    handle.lmcache_instance_id = "vllm-instance"
    node.initialize_worker_connector(None, None, None)


def test_a_cpu_buffer_past_the_memory_available_fails_at_the_workers_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda: (4 * 2**30, 16 * 2**30))
    with pytest.raises(ValueError) as err:
        chain("worker", {"max_local_cpu_size": 8})
    assert str(err.value) == (
        'lmcache node "lm": max_local_cpu_size 8 (8.0GiB of CPU buffer in this vLLM worker '
        "process) is more than the 4.0GiB of memory available on this machine (16.0GiB in "
        "all); lower max_local_cpu_size (each vLLM worker process allocates one)"
    )
    # The scheduler's half allocates none; a buffer that fits starts.
    assert isinstance(
        chain("scheduler", {"max_local_cpu_size": 8}).nodes["lm"], LMCacheInProcessNode
    )
    assert isinstance(chain("worker", {"max_local_cpu_size": 4}).nodes["lm"], LMCacheInProcessNode)
