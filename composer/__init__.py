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
from composer.policy import KINDS as POLICY_KINDS
from composer.policy import (
    AdmissionPolicy,
    Block,
    CachePolicy,
    EvictionPolicy,
    PolicyName,
    PolicyOptions,
    RetentionPolicy,
    policy_options,
)
from composer.policy import Kind as PolicyKind
from composer.simulate import SimKVGroup, SimRequest, TierModel
from composer.validation import load_pipeline, validate_text
from composer.views import RequestView, StepView

__all__ = [
    "AdmissionPolicy",
    "Block",
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
    "POLICY_KINDS",
    "Pipeline",
    "PipelineInvalid",
    "Plugin",
    "PluginType",
    "PolicyKind",
    "PolicyName",
    "PolicyOptions",
    "PositiveByteSize",
    "Problem",
    "Registry",
    "RequestView",
    "ResolvedNode",
    "ResolvedPipeline",
    "Retention",
    "RetentionPolicy",
    "SimKVGroup",
    "SimRequest",
    "StepView",
    "TierModel",
    "Unavailable",
    "VllmConnectorConfig",
    "available_memory",
    "cache_salt_problem",
    "did_you_mean",
    "discover",
    "find_policy",
    "hookimpl",
    "hookspec",
    "kv_transfer_config",
    "load_pipeline",
    "no_kv_blocks",
    "one_of",
    "policy_options",
    "validate_text",
]
