"""KV Composer: compose vLLM KV-cache connectors from a validated graph of plugins.

Importing this package never imports torch or vLLM.
"""

from composer.discovery import Registry, discover
from composer.errors import PipelineInvalid, Problem
from composer.export import kv_transfer_config
from composer.hookspecs import hookimpl, hookspec
from composer.pipeline import Node, Pipeline, ResolvedNode, ResolvedPipeline
from composer.plugin import NodeContext, Plugin
from composer.plugin_types import Capabilities, EmptyConfig, PluginType
from composer.validation import load_pipeline, validate_text
from composer.views import RequestView

__all__ = [
    "Capabilities",
    "EmptyConfig",
    "Node",
    "NodeContext",
    "Pipeline",
    "PipelineInvalid",
    "Plugin",
    "PluginType",
    "Problem",
    "Registry",
    "RequestView",
    "ResolvedNode",
    "ResolvedPipeline",
    "discover",
    "hookimpl",
    "hookspec",
    "kv_transfer_config",
    "load_pipeline",
    "validate_text",
]
