"""LMCache's in-process connector on a machine without CUDA: only its CUDA parts stood in.

LMCache 0.5.6's ``LMCacheConnectorV1Impl`` builds an ``LMCacheManager`` (real,
here) from a ``VllmServiceFactory``, which makes the engine (a GPU connector:
CUDA), the lookup client and server (ZMQ to the worker's engine) and servers.
:class:`StandInFactory` is that factory with those parts replaced by what
LMCache's own code returns: no engine in the scheduler (as LMCache's factory
returns without ``enable_scheduler_bypass_lookup``), a :class:`StandInLookup`
answering as LMCache's lookup clients answer, or, with ``engine_fails``, the
exception a factory raises when its engine cannot be built (LMCache's manager
then runs degraded, its own way). Everything else (the impl, the manager,
LMCache's config, its request-config and key functions) is LMCache's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from lmcache.integration.vllm import vllm_v1_adapter
from lmcache.v1.lookup_client.abstract_client import LookupClientInterface
from lmcache.v1.metadata import LMCacheMetadata
from vllm.config.kv_transfer import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

BLOCK = 16


class StandInLookup(LookupClientInterface):
    """A lookup client answering as LMCache 0.5.6's do.

    ``lookup_cache(id)``: -1 while it holds no result for the request, None while
    an asynchronous lookup is pending, else the hit tokens. ``lookup(...)``
    starts a lookup: with ``pending`` steps left it answers None (as the async
    client does) and the result arrives in ``lookup_cache`` after them; else it
    answers ``hits`` tokens at once (as the sync client does, which keeps it for
    ``lookup_cache`` too). ``clear_lookup_status`` forgets the request, as
    LMCache's clients do once vLLM allocated its blocks.
    """

    def __init__(self, hits: int, pending: int = 0) -> None:
        self.hits = hits
        self.pending = pending
        self.results: dict[str, int | None] = {}
        self.waits: dict[str, int] = {}
        #: Every lookup: (request id, token ids, request configs).
        self.lookups: list[tuple[str, list[int], dict[str, Any] | None]] = []

    def lookup_cache(self, lookup_id: str) -> int | None:
        if lookup_id not in self.results:
            return -1
        if self.waits.get(lookup_id, 0) > 0:
            self.waits[lookup_id] -= 1
            return None
        self.results[lookup_id] = self.hits
        return self.hits

    def lookup(
        self,
        token_ids: torch.Tensor | list[int],
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        self.lookups.append((lookup_id, list(token_ids), request_configs))
        if self.pending:
            self.results[lookup_id] = None
            self.waits[lookup_id] = self.pending - 1
            return None
        self.results[lookup_id] = self.hits
        return self.hits

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.results.pop(lookup_id, None)
        self.waits.pop(lookup_id, None)

    def close(self) -> None:
        pass


class StandInFactory:
    """LMCache's ``VllmServiceFactory`` with its CUDA parts stood in (see the module)."""

    #: What the next factory's lookup client is (set by a test), and whether its
    #: engine fails to build.
    lookup: LookupClientInterface | None = None
    engine_fails: str = ""

    def __init__(self, lmcache_config: Any, vllm_config: Any, role: str) -> None:
        self.lmcache_config = lmcache_config
        self.vllm_config = vllm_config
        self.role = role
        self.metadata: LMCacheMetadata | None = None

    def get_engine_instance_id(self) -> str:
        return "vllm-instance"

    def get_or_create_metadata(self) -> LMCacheMetadata:
        self.metadata = LMCacheMetadata(
            model_name="tiny",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(2, 2, self.lmcache_config.chunk_size, 2, 8),
            role=self.role,
            chunk_size=self.lmcache_config.chunk_size,
        )
        return self.metadata

    def get_or_create_lmcache_engine(self) -> None:
        if StandInFactory.engine_fails:
            # What LMCache's factory raises where its GPU connector cannot be built.
            raise RuntimeError(StandInFactory.engine_fails)
        return None  # the scheduler's, as LMCache's own factory returns it

    def maybe_create_lookup_client(self) -> LookupClientInterface | None:
        return StandInFactory.lookup if self.role == "scheduler" else None

    def maybe_create_prometheus_logger(self) -> None:
        return None

    def maybe_create_lookup_server(self) -> None:
        return None

    def maybe_create_offload_server(self) -> None:
        return None

    def maybe_create_runtime_plugin_launcher(self) -> None:
        return None

    def maybe_create_internal_api_server(self, lmcache_manager: Any) -> None:
        return None

    def maybe_create_health_monitor(self, lmcache_manager: Any) -> None:
        return None


def stand_in(
    monkeypatch: Any, lookup: LookupClientInterface | None, engine_fails: str = ""
) -> None:
    """Make every LMCache impl built from now on use :class:`StandInFactory`."""
    monkeypatch.setattr(vllm_v1_adapter, "VllmServiceFactory", StandInFactory)
    monkeypatch.setattr(StandInFactory, "lookup", lookup)
    monkeypatch.setattr(StandInFactory, "engine_fails", engine_fails)


def vllm_config(num_layers: int = 2) -> Any:
    return SimpleNamespace(
        device_config=SimpleNamespace(device="cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="ComposedConnector", kv_role="kv_both"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, rank=0, world_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK),
        model_config=SimpleNamespace(get_num_layers=lambda parallel_config: num_layers),
    )


def request(
    request_id: str,
    tokens: int,
    cache_salt: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """vLLM's own ``Request`` of ``tokens`` prompt tokens."""
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, tokens + 1)),
        sampling_params=SamplingParams(max_tokens=4, extra_args=extra),
        pooling_params=None,
        cache_salt=cache_salt,
    )
