"""The built-in ``vllm`` plugin type: any connector registered in vLLM's factory."""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from composer.builtin_policies import BUILTIN as BUILTIN_POLICIES
from composer.hookspecs import hookimpl
from composer.model.support import default_support
from composer.pipeline import Port
from composer.plugin_types import Capabilities, PluginType

# What is known of vLLM's own connectors without importing vLLM. The name
# itself is checked against vLLM's registry where vLLM is importable
# (``kvc validate --deep`` and always at engine start).
KNOWN_CONNECTORS: dict[str, Capabilities] = {
    "ExampleConnector": Capabilities(),
    "LMCacheConnectorV1": Capabilities(),
    "LMCacheMPConnector": Capabilities(hma=True, async_save=True, async_load=True),
    "NixlConnector": Capabilities(
        hma=True,
        provides_handshake=True,
        async_load=True,
        transfer_params_keys=frozenset(
            {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
             "remote_host", "remote_port", "tp_size"}
        ),
    ),
    "NixlPullConnector": Capabilities(hma=True, provides_handshake=True, async_load=True),
    "NixlPushConnector": Capabilities(hma=True, provides_handshake=True, async_load=True),
    "MooncakeConnector": Capabilities(provides_handshake=True, async_load=True),
    "MooncakeStoreConnector": Capabilities(async_save=True, async_load=True),
    "OffloadingConnector": Capabilities(hma=True, async_save=True, async_load=True),
    "SimpleCPUOffloadConnector": Capabilities(hma=True, async_save=True, async_load=True),
    "DecodeBenchConnector": Capabilities(),
    "FlexKVConnectorV1": Capabilities(async_save=True, async_load=True),
    "HF3FSKVConnector": Capabilities(async_save=True, async_load=True),
    "MoRIIOConnector": Capabilities(provides_handshake=True, async_load=True),
    "HiSparseConnector": Capabilities(),
}

#: vLLM's connectors that move KV with NIXL (``nixl_poll_ms`` applies to them).
NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})
#: NIXL's Python API as vLLM imports it; its ``nixl_agent`` makes the agent through
#: the ``nixlBind`` bindings.
NIXL_API = "nixl._api"


def nixl_poll_problem() -> str:
    """Why the installed NIXL cannot take ``nixl_poll_ms``; empty when it can (its
    Python API makes agents through ``nixlBind.nixlAgent``, where the node sets it).
    Imports NIXL: for ``kvc validate --deep`` and engine start only."""
    try:
        api = importlib.import_module(NIXL_API)
    except ImportError as e:
        return f"NIXL cannot be imported here: {e}"
    if hasattr(getattr(api, "nixlBind", None), "nixlAgent"):
        return ""
    return f"this NIXL's {NIXL_API} makes no agent through nixlBind.nixlAgent: it cannot be set"


class VllmConnectorConfig(BaseModel):
    """A connector from vLLM's factory, wrapped as one pipeline node."""

    model_config = ConfigDict(extra="forbid")

    connector: str = Field(description="Name in vLLM's KVConnectorFactory, e.g. NixlConnector.")
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = Field(
        None, description="Defaults to the composed connector's kv_role."
    )
    module_path: str | None = Field(
        None, description="kv_connector_module_path for an out-of-tree connector."
    )
    engine_id: str | None = None
    kv_buffer_device: str | None = None
    kv_port: Port | None = Field(None, description="TCP port, 1 to 65535.")
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="The connector's kv_connector_extra_config."
    )
    capabilities: Capabilities | None = Field(
        None, description="Declare capabilities of a connector KV Composer does not know."
    )
    nixl_poll_ms: int | None = Field(
        None,
        ge=0,
        le=1000,
        description=(
            "NIXL connectors only: how long NIXL's progress thread waits for UCX events "
            "between rounds, in ms. NIXL's own is 0: it polls without pause, a core per "
            "engine, idle or not; 1 wakes it on each event and at least every ms. For "
            "hosts without cores to spare (vLLM's CPU build)."
        ),
    )

    @field_validator("nixl_poll_ms")
    @classmethod
    def _only_for_nixl(cls, value: int | None, info: ValidationInfo) -> int | None:
        connector = info.data.get("connector")
        if value is not None and connector not in NIXL_CONNECTORS:
            raise ValueError(
                f"applies to NIXL connectors ({', '.join(sorted(NIXL_CONNECTORS))}), "
                f"not {connector}"
            )
        return value


def _capabilities(config: VllmConnectorConfig) -> Capabilities:
    if config.capabilities is not None:
        return config.capabilities
    return KNOWN_CONNECTORS.get(config.connector, Capabilities())


def model_support(config: VllmConnectorConfig, model: Any) -> str:
    return default_support(_capabilities(config), model)


VLLM = PluginType(
    name="vllm",
    node="composer.vllm.native:NativeConnectorNode",
    config=VllmConnectorConfig,
    description="Any KV connector registered in vLLM's factory, by name.",
    capabilities=_capabilities,
    roles=frozenset({"load", "save", "both", "transport"}),
    # The connector's HMA support decides (KNOWN_CONNECTORS, or the declared capabilities).
    model_support="composer.builtin:model_support",
)


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(VLLM)


@hookimpl
def register_cache_policies(register: Any) -> None:
    for policy in BUILTIN_POLICIES:
        register(policy)
