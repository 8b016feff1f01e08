"""Checks that need vLLM itself: native connector names against vLLM's real registry.

``kvc validate --deep`` runs these, and the vLLM adapter runs them at engine
start. vLLM is imported only inside :func:`deep_check`, so importing this module
stays as light as ``import composer``.
"""

from __future__ import annotations

from collections.abc import Iterable

from composer.errors import Problem, did_you_mean, one_of
from composer.loader import Marks
from composer.pipeline import ResolvedPipeline


def vllm_connector_names() -> frozenset[str]:
    """Names registered in the installed vLLM's ``KVConnectorFactory`` (imports vLLM)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return frozenset(KVConnectorFactory._registry)


def deep_check(
    pipeline: ResolvedPipeline,
    *,
    marks: Marks | None = None,
    registered: Iterable[str] | None = None,
) -> list[Problem]:
    """Problems only vLLM can reveal; an empty list when there are none.

    ``marks`` (from :func:`composer.loader.load_yaml`) locates problems in the
    pipeline file; without them problems carry the file name only.
    ``registered`` overrides the connector names read from vLLM.
    """
    natives = [n for n in pipeline.nodes if n.plugin.name == "vllm"]
    if not natives:
        return []
    names = frozenset(registered) if registered is not None else vllm_connector_names()
    marks = marks or Marks()
    problems: list[Problem] = []
    for node in natives:
        # An out-of-tree connector is loaded from its module path, not looked up by name.
        if getattr(node.config, "module_path", None):
            continue
        connector = str(getattr(node.config, "connector", ""))
        if connector in names:
            continue
        path = ("nodes", node.id, "config", "connector")
        line, column = marks.locate(path)
        problems.append(
            Problem(
                path,
                f'vLLM has no KV connector "{connector}"{did_you_mean(connector, names)}; '
                f"registered: {one_of(names)} (set module_path for an out-of-tree connector)",
                pipeline.file,
                line,
                column,
            )
        )
    return problems
