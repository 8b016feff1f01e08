"""KV Composer plugin types for the dispatch benchmark (no vLLM needed).

* ``dispatch-saver`` implements only ``save_kv_layer`` and ``wait_for_save``;
* ``dispatch-empty`` implements no hook at all.

Registered through ``KV_COMPOSER_PLUGIN_MODULES=benchmarks.dispatch_nodes``.
"""

from __future__ import annotations

from typing import Any

from composer import Plugin, PluginType, hookimpl


class SaverNode(Plugin):
    @hookimpl
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        return None

    @hookimpl
    def wait_for_save(self) -> None:
        return None


class EmptyNode(Plugin):
    pass


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="dispatch-saver", node=SaverNode, description="save_kv_layer + wait_for_save only"
        )
    )
    register(PluginType(name="dispatch-empty", node=EmptyNode, description="implements no hook"))
