"""The ``lmcache`` node's options (validated before vLLM starts, without torch).

``import lmcache`` imports torch (seconds, the README says), so validation never imports it.
Instead the names LMCache knows are read from the source of
``lmcache/v1/config.py`` (its single ``_CONFIG_DEFINITIONS`` table) with
:mod:`ast` (:func:`kvc_lmcache.lmcache_internals.lmcache_field_names`): a
typo'd field in ``extra`` is reported by ``kvc validate``. The values
themselves are applied and checked by LMCache's own
``validate_and_set_config_value`` when the in-process connector starts.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer import Int, Number, did_you_mean
from kvc_lmcache.l2 import L2Adapter
from kvc_lmcache.lmcache_internals import lmcache_field_names
from kvc_lmcache.sizes import GB

TCP_URL = re.compile(r"^tcp://(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")
HTTP_URL = re.compile(r"^https?://[^:/\s]+:\d{1,5}/?$")

TransferMode = Literal["auto", "lmcache_driven", "engine_driven"]

#: Fields of LMCache's engine config that this model has as first-class options.
ENGINE_FIELDS = (
    "chunk_size",
    "local_cpu",
    "max_local_cpu_size",
    "local_disk",
    "max_local_disk_size",
    "remote_url",
    "remote_serde",
    "save_unfull_chunk",
    "cache_policy",
    "use_layerwise",
    "enable_blending",
    "blend_recompute_ratios",
    "blend_thresholds",
    "blend_check_layers",
    "blend_min_tokens",
    "blend_special_str",
)
#: Engine fields that only an in-process LMCache engine reads; a server is
#: configured through ``server`` instead (see the README).
IN_PROCESS_ONLY = tuple(f for f in ENGINE_FIELDS if f != "chunk_size")


class ServerConfig(BaseModel):
    """LMCache multiprocess mode: a ``lmcache server`` process and vLLM's LMCacheMPConnector."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str | None = Field(
        default=None,
        description="tcp://host:port of a running `lmcache server`; null: start one (start: true)",
    )
    http_url: str | None = Field(
        default=None,
        description=(
            "http://host:port of that server's HTTP frontend (--http-port). When set, the node "
            "checks its health, chunk size and transfer mode before vLLM connects."
        ),
    )
    start: bool = Field(
        default=True,
        description="With url: null, start and own a local server (loopback, free ports).",
    )
    l1_size_gb: GB = Field(default=1.0, gt=0, description="Started server: --l1-size-gb.")
    eviction_policy: Literal["LRU", "ARC", "IsolatedLRU", "noop"] = Field(
        default="LRU", description="Started server: --eviction-policy."
    )
    chunk_size: Int | None = Field(
        default=None,
        ge=1,
        description=(
            "Started server: --chunk-size (default: the node's chunk_size). Must be a multiple "
            "of vLLM's block size."
        ),
    )
    transfer_mode: TransferMode = Field(
        default="auto",
        description=(
            "lmcache.mp.mp_transfer_mode of the connector; a started server is given a matching "
            "--supported-transfer-mode. auto picks engine_driven on CPU. On CPU, lmcache_driven "
            "moves vLLM's KV cache tensors into shared memory under every other node (an error "
            "at start-up), so keep auto or engine_driven there."
        ),
    )
    mq_timeout: Number = Field(
        default=30.0,
        gt=0,
        description="lmcache.mp.mq_timeout, seconds (LMCache's own default is 300).",
    )
    heartbeat_interval: Number | None = Field(
        default=None, gt=0, description="lmcache.mp.heartbeat_interval, seconds."
    )
    startup_timeout: Number = Field(
        default=120.0, gt=0, description="Seconds to wait for a started server to be healthy."
    )
    restarts: Int = Field(
        default=5,
        ge=0,
        description=(
            "Started server: when it dies, start it again where it was (same ports), at most "
            "this many tries per outage, 1, 2, 4, ... s apart; 0: never (its store stays "
            "away until vLLM restarts). A given server (url) is waited for, never started."
        ),
    )
    l2: list[L2Adapter] = Field(
        default_factory=list,
        description=(
            "Started server: storage tiers under its L1, in order (one --l2-adapter each): "
            "resp (Redis/Valkey), valkey (valkey-glide), fs (a directory), or any other "
            "LMCache adapter by name. A Valkey shared by several servers is a fleet-wide cache."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More `lmcache server` flags for a started server.",
    )
    command_prefix: list[str] = Field(
        default_factory=list,
        description=(
            "Started server: a command it runs under, on every start and restart "
            "(e.g. [numactl, --cpunodebind=1] or [taskset, -c, 2-3]); it must exec the "
            "command that follows it, so that the node watches the server itself."
        ),
    )

    @field_validator("url")
    @classmethod
    def _tcp_url(cls, value: str | None) -> str | None:
        if value is not None and not TCP_URL.match(value):
            raise ValueError(f"expected tcp://host:port, got {value!r}")
        return value

    @field_validator("http_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not HTTP_URL.match(value):
            raise ValueError(f"expected http://host:port, got {value!r}")
        return value

    @field_validator("extra_args")
    @classmethod
    def _owned_flags(cls, value: list[str]) -> list[str]:
        owned = {
            "--host",
            "--port",
            "--http-host",
            "--http-port",
            "--chunk-size",
            "--l1-size-gb",
            "--eviction-policy",
            "--supported-transfer-mode",
        }
        for arg in value:
            if arg.split("=", 1)[0] in owned:
                raise ValueError(f"{arg.split('=', 1)[0]} is set by the node; use its own option")
        return value

    @model_validator(mode="after")
    def _a_server(self) -> ServerConfig:
        if self.url is None and not self.start:
            raise ValueError("no server: set url to a running `lmcache server`, or start: true")
        if self.url is not None and "start" in self.model_fields_set and self.start:
            raise ValueError("url and start: true both given; a server is either given or started")
        if self.url is not None and self.l2:
            raise ValueError(
                "l2: tiers of a server this node starts; a given server (url) has its own "
                "--l2-adapter flags"
            )
        return self


class LMCacheConfig(BaseModel):
    """LMCache as a pipeline node: a multiprocess server (default) or an in-process engine."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["server", "in_process"] = Field(
        default="server",
        description=(
            "server: vLLM's LMCacheMPConnector talking to a `lmcache server` (works on CPU). "
            "in_process: LMCache's own vLLM connector inside the worker (needs a GPU)."
        ),
    )
    server: ServerConfig = Field(default_factory=ServerConfig, description="Server mode options.")

    chunk_size: Int = Field(default=256, ge=1, description="Tokens per LMCache chunk.")
    local_cpu: bool = Field(default=True, description="in_process: keep chunks in CPU memory.")
    max_local_cpu_size: GB = Field(default=5.0, ge=0, description="in_process: GB of CPU cache.")
    local_disk: str | None = Field(default=None, description="in_process: local disk cache path.")
    max_local_disk_size: GB = Field(default=0.0, ge=0, description="in_process: GB on disk.")
    remote_url: str | None = Field(default=None, description="in_process: remote backend URL.")
    remote_serde: str | None = Field(default="naive", description="in_process: remote serde.")
    save_unfull_chunk: bool = Field(
        default=False, description="in_process: save a partial last chunk."
    )
    cache_policy: str = Field(default="LRU", description="in_process: eviction policy.")
    use_layerwise: bool = Field(default=False, description="in_process: layer-wise transfers.")
    enable_blending: bool = Field(
        default=False,
        description="in_process: CacheBlend; needs a model-tracker node in `needs`.",
    )
    blend_recompute_ratios: list[Number] | None = None
    blend_thresholds: list[Number] | None = None
    blend_check_layers: list[Int] | None = None
    blend_min_tokens: Int = Field(default=256, ge=0)
    blend_special_str: str = " # # "
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Other LMCache engine config fields by name (checked against LMCache's).",
    )

    kv_cache_group: Int | None = Field(
        default=None,
        ge=0,
        description=(
            "in_process with vLLM's hybrid allocator: the full-attention KV cache group LMCache "
            "handles; its block ids are what request_finished_all_groups forwards."
        ),
    )

    @field_validator("extra")
    @classmethod
    def _known_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        known = lmcache_field_names()
        for key in value:
            if key in ENGINE_FIELDS:
                raise ValueError(
                    f'"{key}" is an option of this node: set it directly, not in extra'
                )
            if known is not None and key not in known:
                raise ValueError(f'LMCache has no config field "{key}"{did_you_mean(key, known)}')
        return value

    @model_validator(mode="after")
    def _mode_fits(self) -> LMCacheConfig:
        if self.mode == "server":
            wrong = [f for f in IN_PROCESS_ONLY if f in self.model_fields_set]
            if wrong:
                raise ValueError(
                    f"{', '.join(wrong)}: in-process LMCache options, but mode is server; "
                    "configure the server through server.* (server.extra_args for its L2 "
                    "adapters) or set mode: in_process"
                )
            if self.extra:
                raise ValueError("extra: in-process LMCache options, but mode is server")
            if self.kv_cache_group is not None:
                raise ValueError(
                    "kv_cache_group: for mode in_process; the LMCache server handles every group"
                )
        elif "server" in self.model_fields_set:
            raise ValueError("server: options for mode server, but mode is in_process")
        return self

    # -- what reaches LMCache --------------------------------------------------- #

    def engine_config(self) -> dict[str, Any]:
        """The LMCache engine config fields this node sets (in_process)."""
        out = {f: getattr(self, f) for f in ENGINE_FIELDS}
        if out["blend_recompute_ratios"] is None:
            del out["blend_recompute_ratios"]
        if out["blend_thresholds"] is None:
            del out["blend_thresholds"]
        if out["blend_check_layers"] is None:
            del out["blend_check_layers"]
        out.update(self.extra)
        return out

    def server_chunk_size(self) -> int:
        return self.server.chunk_size or self.chunk_size

    def tiers(self) -> list[str]:
        """The storage tiers behind the node, fastest first (``kvc graph`` shows them)."""
        if self.mode != "server":
            return [f"in-process LMCache, CPU {self.max_local_cpu_size:g} GB"]
        if self.server.url is not None:
            return [f"lmcache server {self.server.url} (its tiers are its own)"]
        return [
            f"L1: started lmcache server, {self.server.l1_size_gb:g} GB",
            *(f"L2: {tier.describe()}" for tier in self.server.l2),
        ]
