"""Adapts vLLM's ``tests/v1/kv_connector/unit/test_multi_connector.py`` to ComposedConnector.

vLLM's file is read from the installed version's sdist (:mod:`vllm_source`) and
executed as ``tests.v1.kv_connector.unit.test_multi_connector`` after the
textual rewrites in :data:`REWRITES`, each of which must match exactly as often
as listed (so a change in vLLM's file shows up here, not as a silently weaker
test). What is rewritten, and nothing else:

* MultiConnector configurations become pipelines: the helper
  ``create_vllm_config`` of vLLM's tests is wrapped so that a MultiConnector
  config comes back as the same children, in order, as ``vllm`` nodes of a
  ComposedConnector pipeline (``composer.testing.multiconnector``); its default
  model (a Hugging Face download) is the tiny local model, which these tests
  only need for vLLM's config checks.
* Names: MultiConnector -> ComposedConnector, MultiKVConnectorStats ->
  ComposedStats, MultiKVConnectorWorkerMetadata -> ComposedWorkerMetadata,
  MultiKVConnectorPromMetrics -> ComposedPromMetrics; constructing a
  MultiConnector builds a ComposedConnector from the translated config.
* Data shapes with an obvious equivalent: MultiConnector's per-connector stats
  payload ``{name: child stats}`` is the composed per-node payload
  ``{node: {"plugin": "vllm", "connector": {"name": name}, "counters": {},
  "node": child stats}}``, and ``<stats>.data[name]`` (a child's stats object)
  is ``<stats>.native[node]``; ``<worker meta>.metadata`` (children's metadata by
  position) is the per-node metadata in node order; the prom-metrics children
  ``_prom_metrics`` are ``per_node``.
* Private attributes of a MultiConnector instance: ``_connectors`` (read and
  replaced) are the native nodes' connectors, ``_requests_to_connector`` the
  chain's choice of node per request, ``_all_support_hma`` the runtime
  pipeline's ``hma``.

Every assertion of vLLM's file is kept as it is.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterator, MutableMapping
from types import ModuleType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm_source import tests_root

from composer.chain.scheduler import Range
from composer.testing.multiconnector import node_ids, pipeline_for
from composer.testing.tiny_model import build_tiny_model
from composer.vllm.connector import ComposedConnector, ComposedStats
from composer.vllm.native import NativeConnectorNode
from composer.vllm.registration import register

MODULE = "tests.v1.kv_connector.unit.test_multi_connector"
UTILS = "tests.v1.kv_connector.unit.utils"
CONFTEST = "tests.v1.kv_connector.unit.conftest"

#: vLLM tests that cannot run here, and why. Every other test of the file runs.
NOT_APPLICABLE: dict[str, str] = {
    "test_multi_example_connector_consistency": (
        "runs meta-llama/Llama-3.2-1B-Instruct through vllm.LLM: a Hugging Face model "
        "download (none is reachable here) and GPU-sized; ComposedConnector against "
        "MultiConnector on real engines is tests/e2e/test_adapter_e2e.py"
    ),
    "test_multi_connector_mixed_hma_disables_hybrid_kv_cache": (
        "needs CUDA (vLLM skips it without) and downloads Qwen/Qwen3-0.6B; the same claim "
        "(a mix of HMA and non-HMA children switches vLLM's hybrid KV cache manager off) "
        "is tested on CPU by tests/test_connector_surface.py::"
        "test_vllm_switches_the_hybrid_manager_off_unless_every_node_supports_hma"
    ),
}

_IMPORT_OLD = """from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorPromMetrics,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
)"""
_IMPORT_NEW = """from composer.vllm.connector import (
    ComposedConnector,
    ComposedPromMetrics,
    ComposedStats,
    ComposedWorkerMetadata,
)"""

#: (pattern, replacement, matches expected). Applied in order; none adds a line,
#: so tracebacks point at vLLM's own line numbers.
REWRITES: list[tuple[str, str, int]] = [
    (re.escape(_IMPORT_OLD), _IMPORT_NEW, 1),
    # constructing
    (r"object\.__new__\(MultiConnector\)", "_kvc.bare_connector()", 1),
    (r"(=|return) MultiConnector\(", r"\1 _kvc.multi_connector(", 2),
    (r"MultiConnector\.build_kv_connector_stats\(data=", "_kvc.build_kv_connector_stats(data=", 8),
    (r"MultiKVConnectorStats\(", "_kvc.multi_stats(", 8),
    # data shapes
    (
        r"stats\.to_dict\(\) == serialized_data",
        "stats.to_dict() == _kvc.payload(serialized_data)",
        1,
    ),
    (r"\b(stats|result)\.data\b", r"\1.native", 28),
    (r"\b(mc_worker_meta_\w+)\.metadata\b", r"_kvc.by_child(mc, \1)", 7),
    (r"metrics\._prom_metrics = ", "metrics.per_node = ", 1),
    (
        r'payload = (\{"NixlConnector": \{"transfer_duration": \[1\.5\]\}\})',
        r"payload = _kvc.payload(\1)",
        1,
    ),
    # the remaining names (not inside strings: configs still say "MultiConnector")
    (r'(?<!["\w])MultiConnector\b(?!")', "ComposedConnector", 27),
    (r"\bMultiKVConnectorStats\b", "ComposedStats", 6),
    (r"\bMultiKVConnectorWorkerMetadata\b", "ComposedWorkerMetadata", 6),
    (r"\bMultiKVConnectorPromMetrics\b", "ComposedPromMetrics", 1),
]


def adapt(source: str) -> str:
    for pattern, replacement, expected in REWRITES:
        source, found = re.subn(pattern, replacement, source)
        if found != expected:
            raise AssertionError(
                f"vLLM's test file changed: {pattern!r} matched {found} times, "
                f"not {expected}; review the adaptation"
            )
    return source


# --------------------------------------------------------------------------- #
# What the rewritten file calls (as ``_kvc``)
# --------------------------------------------------------------------------- #


def _children_node_ids(connector: ComposedConnector) -> list[str]:
    return [n.id for n in connector.pipeline.nodes]


class _ChosenByIndex(MutableMapping[str, int]):
    """MultiConnector's ``_requests_to_connector`` (request -> child index) over the
    chain's plan per request (one range: MultiConnector's one child)."""

    def __init__(self, connector: ComposedConnector) -> None:
        self.chain = connector.chain
        self.ids = _children_node_ids(connector)

    def __getitem__(self, request_id: str) -> int:
        return self.ids.index(self.chain.chosen[request_id][0].node)

    def __setitem__(self, request_id: str, index: int) -> None:
        self.chain.chosen[request_id] = [Range(self.ids[index], 0, 0, False)]

    def __delitem__(self, request_id: str) -> None:
        del self.chain.chosen[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.chain.chosen)

    def __len__(self) -> int:
        return len(self.chain.chosen)


class AdaptedComposedConnector(ComposedConnector):
    """A ComposedConnector answering to MultiConnector's private attribute names."""

    @property
    def _connectors(self) -> list[Any]:
        return self.sub_connectors

    @_connectors.setter
    def _connectors(self, connectors: list[Any]) -> None:
        # vLLM's tests swap children one for one: each native node gets the new
        # connector and the chain binds its calls again.
        natives = [n for n in self.chain.nodes.values() if isinstance(n, NativeConnectorNode)]
        assert len(natives) == len(connectors), "children are replaced one for one"
        for node, connector in zip(natives, connectors, strict=True):
            node.connector = connector
        self.chain.rebind()

    @property
    def _requests_to_connector(self) -> _ChosenByIndex:
        return _ChosenByIndex(self)

    @property
    def _all_support_hma(self) -> bool:
        return self.pipeline.hma


def multi_connector(
    vllm_config: Any, role: KVConnectorRole, kv_cache_config: KVCacheConfig
) -> AdaptedComposedConnector:
    connector = vllm_config.kv_transfer_config.kv_connector
    assert connector == "ComposedConnector", f"a config not translated to a pipeline: {connector}"
    return AdaptedComposedConnector(
        vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config
    )


def bare_connector() -> AdaptedComposedConnector:
    """``object.__new__(MultiConnector)`` before its test sets two children: a
    composed connector of two placeholder nodes, which the test then replaces."""
    placeholder = {
        "kv_connector": "MockConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": MODULE,
    }
    utils = sys.modules[UTILS]
    config = utils.create_vllm_config(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": [placeholder, placeholder]},
    )
    empty = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
    return multi_connector(config, KVConnectorRole.WORKER, empty)


def payload(data: dict[str, Any]) -> dict[str, Any]:
    """MultiConnector's stats payload ``{connector name: child stats}`` per node."""
    return {
        name: {"plugin": "vllm", "connector": {"name": name}, "counters": {}, "node": child}
        for name, child in data.items()
    }


def multi_stats(data: dict[str, Any] | None = None) -> ComposedStats:
    return ComposedStats(data=payload(data or {}))


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> Any:
    return ComposedConnector.build_kv_connector_stats(data=None if data is None else payload(data))


def by_child(connector: ComposedConnector, worker_meta: Any) -> tuple[Any, ...]:
    return tuple(worker_meta.per_node.get(n) for n in _children_node_ids(connector))


def _translating(create_vllm_config: Callable[..., Any]) -> Callable[..., Any]:
    model = str(build_tiny_model())

    def create(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("model", model)
        if kwargs.get("kv_connector") == "MultiConnector":
            extra = kwargs.get("kv_connector_extra_config") or {}
            children = extra["connectors"]
            kwargs["kv_connector"] = "ComposedConnector"
            kwargs["kv_connector_extra_config"] = {
                "pipeline": pipeline_for(children, kwargs.get("kv_role", "kv_consumer"))
            }
        return create_vllm_config(*args, **kwargs)

    return create


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def load() -> ModuleType:
    """vLLM's test module, adapted (once per process: it registers connectors)."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    register()  # ComposedConnector in vLLM's factory, as vLLM's plugin loading does
    root = tests_root()
    try:
        importlib.import_module("tests")
    except ImportError:
        sys.modules["tests"] = ModuleType("tests")
    v1 = ModuleType("tests.v1")
    v1.__path__ = [str(root / "v1")]
    sys.modules["tests.v1"] = v1
    utils = importlib.import_module(UTILS)
    utils.create_vllm_config = _translating(utils.create_vllm_config)
    importlib.import_module(CONFTEST)
    path = root / "v1" / "kv_connector" / "unit" / "test_multi_connector.py"
    module = ModuleType(MODULE)
    module.__file__ = str(path)
    module.__dict__["_kvc"] = sys.modules[__name__]
    sys.modules[MODULE] = module
    try:
        exec(compile(adapt(path.read_text()), str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[MODULE]
        raise
    return module


def collected(module: ModuleType) -> dict[str, Any]:
    """The tests (functions and Test classes) and fixtures of the module that run here."""
    out: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name in NOT_APPLICABLE:
            continue
        is_test = name.startswith("test_") and callable(value)
        is_class = name.startswith("Test") and isinstance(value, type)
        is_fixture = hasattr(value, "_fixture_function_marker") or type(value).__name__ == (
            "FixtureFunctionDefinition"
        )
        if is_test or is_class or is_fixture:
            out[name] = value
    return out


def vllm_test_names(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if (name.startswith("test_") and callable(value))
        or (name.startswith("Test") and isinstance(value, type))
    }


__all__ = [
    "NOT_APPLICABLE",
    "bare_connector",
    "build_kv_connector_stats",
    "by_child",
    "collected",
    "load",
    "multi_connector",
    "multi_stats",
    "node_ids",
    "payload",
    "vllm_test_names",
]
