"""What a node serves of a model's KV cache groups: its plugin type's ``model_support``,
or the default rule judged from its HMA capability (no torch, no vLLM).

:mod:`composer.validation.model_check` applies these to a whole pipeline before
launch (``kvc validate --model``) and at engine start.
"""

from __future__ import annotations

from pydantic import BaseModel

from composer.model.kv_groups import ModelKV, ModelUnsupported
from composer.pipeline import ResolvedNode
from composer.plugin_types import Capabilities, PluginTypeError, resolve_ref


def default_support(capabilities: Capabilities, model: ModelKV) -> str:
    """What a node with no ``model_support`` serves, judged from its HMA capability."""
    if len(model.groups) <= 1:
        return "serves the model's one KV cache group"
    if capabilities.hma:
        return f"serves every KV cache group ({model.kinds_label})"
    if "mamba" in model.kinds:
        raise ModelUnsupported(
            f"does not support vLLM's hybrid KV cache manager, which the {model.kinds_label} "
            f"groups of {model.label} need: vLLM cannot start (\"Failed to promote local KV "
            'cache specs to one unified type"); remove the node or serve another model'
        )
    return (
        "warning: does not support vLLM's hybrid KV cache manager, so vLLM turns it off: "
        "one group, sliding-window layers keep the whole context"
    )


def no_kv_blocks(config: BaseModel, model: ModelKV) -> str:
    """``model_support`` of a node that never touches KV blocks (a service node)."""
    return "touches no KV blocks"


def node_support(node: ResolvedNode, model: ModelKV) -> str:
    """The node's line for ``model``; raises :class:`ModelUnsupported` to refuse it."""
    ref = node.plugin.model_support
    if ref is None and node.role == "service":
        return no_kv_blocks(node.config, model)
    if ref is None:
        return default_support(node.capabilities, model)
    support = resolve_ref(ref)
    if not callable(support):
        raise PluginTypeError(
            f'plugin type "{node.plugin.name}": model_support {ref!r} is not a function'
        )
    return str(support(node.config, model))
