"""An ExampleConnector that records every call vLLM makes on it, with its results.

Used by the parity test: the same recording child under vLLM's MultiConnector
and under the composed connector must see the same calls, in the same order,
with the same arguments and results.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

# Per-layer calls are recorded too, but only their layer name.
_SKIP = {"role", "supports_divergent_local_hybrid_hits", "requires_kv_delivery"}


def _summary(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_summary(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_summary(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _summary(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if hasattr(value, "request_id"):
        return f"request:{value.request_id}"
    if type(value).__name__ == "KVCacheBlocks":
        return ["blocks", _summary(value.get_block_ids())]
    if hasattr(value, "finished_sending"):
        return ["results", _summary(value.finished_sending), _summary(value.finished_recving)]
    if hasattr(value, "requests") and type(value).__name__.endswith("Metadata"):
        # ExampleConnector's metadata: what it loads or stores, request by request.
        return [type(value).__name__, [[len(r.token_ids), r.is_store] for r in value.requests]]
    return type(value).__name__


class RecordingConnector(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._record = open(f"{extra['record_path']}.{role.name.lower()}", "a")  # noqa: SIM115

    def _log(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        if name in ("save_kv_layer", "wait_for_layer_load"):
            args = args[:1]
        self._record.write(json.dumps([name, _summary(list(args)), _summary(result)]) + "\n")
        self._record.flush()


def _wrap(name: str) -> Any:
    base = getattr(ExampleConnector, name)

    def method(self: RecordingConnector, *args: Any, **kwargs: Any) -> Any:
        result = base(self, *args, **kwargs)
        if name == "take_events":
            result = list(result)
        self._log(name, args, result)
        return result

    method.__name__ = name
    return method


for _name in dir(KVConnectorBase_V1):
    _attr = getattr(KVConnectorBase_V1, _name)
    if _name.startswith("_") or _name in _SKIP or isinstance(_attr, (property, classmethod)):
        continue
    if isinstance(KVConnectorBase_V1.__dict__.get(_name), classmethod):
        continue
    if callable(_attr):
        setattr(RecordingConnector, _name, _wrap(_name))

os.environ.setdefault("KV_COMPOSER_RECORDING", "1")
