"""KV Composer: compose vLLM KV-cache connectors from a validated graph of plugins.

This namespace is the plugin API: a plugin imports from ``composer`` (and
``composer.vllm``, ``composer.servers``), never from the modules below them,
which may move. Importing this package never imports torch or vLLM.
"""

from composer.builtin import VllmConnectorConfig
from composer.controls import Retention, cache_salt_problem
from composer.discovery import Registry, discover, find_policy
from composer.errors import PipelineInvalid, Problem, did_you_mean, one_of
from composer.export import kv_transfer_config
from composer.hookspecs import hookimpl, hookspec
from composer.kv_caches import NULL_BLOCK, CanonicalKVCaches, KVGroup, KVRegion
from composer.memory import available_memory
from composer.model.kv_groups import ModelKV, ModelUnsupported
from composer.model.support import no_kv_blocks
from composer.pipeline import (
    MAX_BYTE_SIZE,
    Int,
    Node,
    Number,
    Pipeline,
    PositiveByteSize,
    ResolvedNode,
    ResolvedPipeline,
)
from composer.plugin import NodeContext, Plugin, Unavailable
from composer.plugin_types import Capabilities, EmptyConfig, NodeRole, PluginType
from composer.policy import (
    AdmissionPolicy,
    CachePolicy,
    EvictionPolicy,
    PolicyName,
    RetentionPolicy,
)
from composer.simulate import SimKVGroup, SimRequest, TierModel
from composer.validation import load_pipeline, validate_text
from composer.views import RequestView, StepView

__all__ = [
    "AdmissionPolicy",
    "CachePolicy",
    "CanonicalKVCaches",
    "Capabilities",
    "EmptyConfig",
    "EvictionPolicy",
    "Int",
    "KVGroup",
    "KVRegion",
    "MAX_BYTE_SIZE",
    "ModelKV",
    "ModelUnsupported",
    "NULL_BLOCK",
    "Node",
    "NodeContext",
    "NodeRole",
    "Number",
    "Pipeline",
    "PipelineInvalid",
    "Plugin",
    "PluginType",
    "PolicyName",
    "PositiveByteSize",
    "Problem",
    "Registry",
    "RequestView",
    "Retention",
    "RetentionPolicy",
    "ResolvedNode",
    "ResolvedPipeline",
    "SimKVGroup",
    "SimRequest",
    "StepView",
    "TierModel",
    "Unavailable",
    "VllmConnectorConfig",
    "available_memory",
    "did_you_mean",
    "discover",
    "cache_salt_problem",
    "find_policy",
    "hookimpl",
    "hookspec",
    "kv_transfer_config",
    "load_pipeline",
    "no_kv_blocks",
    "one_of",
    "validate_text",
]
