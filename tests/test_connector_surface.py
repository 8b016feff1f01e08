"""The composed connector overrides the whole KVConnectorBase_V1 surface of the installed vLLM."""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import pytest
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from composer.hook_table import HOOKS, Every, Native, hooks_where
from composer.hookspecs import NodeSpec
from composer.testing.multiconnector import make_vllm_config, node_ids, pipeline_for
from composer.vllm.connector import WORKER_HOT_PATH, ComposedConnector
from composer.vllm.registration import register

#: Base-class members the composed connector answers itself, from the pipeline or
#: its nodes' connector classes, rather than through a lifecycle hook of its nodes.
#: (Every other public member is a hook of :class:`composer.hookspecs.NodeSpec`; the test
#: below checks it.)
COMPOSER_LEVEL = frozenset(
    {
        "role",
        "has_connector_metadata",  # the chain holds the step's metadata
        "get_finished",  # answered from get_transfer_results, as MultiConnector does
        # Asked of the class, before any node exists: the pipeline and the native
        # nodes' connector classes answer.
        "get_required_kvcache_layout",
        "requires_piecewise_for_cudagraph",
        "build_kv_connector_stats",
        "build_prom_metrics",
        "supports_sleep_mode",
        # Properties over the native nodes' connectors, as MultiConnector's.
        "supports_divergent_local_hybrid_hits",
        "requires_kv_delivery",
    }
)


def public_members(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_every_public_member_of_the_base_class_is_overridden() -> None:
    missing = sorted(
        name
        for name in public_members(KVConnectorBase_V1)
        if name not in ComposedConnector.__dict__
    )
    assert missing == [], f"ComposedConnector does not override: {missing}"


def test_supports_hma_and_is_concrete() -> None:
    assert issubclass(ComposedConnector, SupportsHMA)
    assert not inspect.isabstract(ComposedConnector)


def test_every_base_class_method_has_a_hook_or_is_composer_level() -> None:
    hooks = {name for name in dir(NodeSpec) if not name.startswith("_")}
    uncovered = sorted(public_members(KVConnectorBase_V1) - hooks - COMPOSER_LEVEL)
    assert uncovered == [], f"base-class methods with no lifecycle hook: {uncovered}"


# --------------------------------------------------------------------------- #
# Parity with MultiConnector on what vLLM hands a connector and asks of it.
# --------------------------------------------------------------------------- #


class RecordingConnector(KVConnectorBase_V1):
    """An out-of-tree connector (found by module path) recording what it is given."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.pool = extra.get("pool")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append(("start_load_kv", (forward_context,), kwargs))

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.calls.append(("save_kv_layer", (layer_name, kv_layer, attn_metadata), kwargs))

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return KVConnectorMetadata()

    def get_mem_pool_context(self) -> Any:
        return nullcontext(self.pool) if self.pool else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return RecordedStats(data={"moved": [1, 2]})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return RecordedStats(data=data if data is not None else {"moved": []})


class RecordedStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {"moved": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["moved"] += other.data["moved"]
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"Moved": sum(self.data["moved"])}

    def is_empty(self) -> bool:
        return not self.data["moved"]


class RecordingHMAConnector(RecordingConnector, SupportsHMA):
    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return False, None


def child(cls: type, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": cls.__name__,
        "kv_role": "kv_both",
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def registered() -> None:
    register()


def composed(
    children: list[dict[str, Any]], role: KVConnectorRole = KVConnectorRole.WORKER
) -> ComposedConnector:
    config = make_vllm_config(children, disable_hybrid_kv_cache_manager=True)
    no_cache = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
    return ComposedConnector(config, role, no_cache)


def _importable(name: str) -> bool:
    try:
        KVConnectorFactory.get_connector_class_by_name(name)
    except ImportError:  # MoRIIO needs msgpack, not part of vLLM's CPU build
        return False
    return True


def _installed(name: str) -> bool:
    """Registered by an installed package, not by a test module (vLLM's own test
    suite, tests/vllm_suite, registers its mocks when collected first)."""
    cls = KVConnectorFactory.get_connector_class_by_name(name)
    site_packages = Path(vllm.__file__).resolve().parents[1]
    return Path(inspect.getfile(cls)).resolve().is_relative_to(site_packages)


IN_TREE = sorted(n for n in KVConnectorFactory._registry if _importable(n) and _installed(n))


@pytest.mark.parametrize("name", [*IN_TREE, "RecordingConnector", "RecordingHMAConnector"])
def test_hma_support_of_a_native_node_is_its_connector_class(registered: None, name: str) -> None:
    if name.startswith("Recording"):
        spec = child(globals()[name])
    else:
        spec = {"kv_connector": name, "kv_role": "kv_both"}
        if name == "MultiConnector":
            spec["kv_connector_extra_config"] = {"connectors": [child(RecordingHMAConnector)]}
    expected = KVConnectorFactory.supports_hma_config(KVTransferConfig(**spec))
    transfer = KVTransferConfig(
        kv_connector="ComposedConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": pipeline_for([spec])},
    )
    assert ComposedConnector.all_nodes_support_hma(transfer) is expected
    # vLLM's own question about the composed connector gets the same answer.
    assert KVConnectorFactory.supports_hma_config(transfer) is expected


@pytest.mark.parametrize(
    ("kinds", "hybrid_off"),
    [
        ((RecordingHMAConnector, RecordingConnector), True),
        ((RecordingConnector, RecordingHMAConnector), True),
        ((RecordingConnector, RecordingConnector), True),
        ((RecordingHMAConnector, RecordingHMAConnector), False),
    ],
)
def test_vllm_switches_the_hybrid_manager_off_unless_every_node_supports_hma(
    registered: None, kinds: tuple[type, ...], hybrid_off: bool
) -> None:
    config = make_vllm_config([child(k) for k in kinds])
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is hybrid_off


KWARGS = {"request_ids": ["r1"], "num_tokens": 7}


@pytest.mark.parametrize("nodes", [1, 2])
def test_keyword_arguments_reach_every_native_node(registered: None, nodes: int) -> None:
    connector = composed([child(RecordingConnector) for _ in range(nodes)])

    def call(name: str) -> Any:
        return getattr(connector, name)

    call("start_load_kv")("fc", **KWARGS)
    call("save_kv_layer")("layer.0", "kv", "attn", **KWARGS)
    call("start_load_kv")("fc")
    call("save_kv_layer")("layer.0", "kv", "attn")
    for sub in connector.sub_connectors:
        assert cast(RecordingConnector, sub).calls == [
            ("start_load_kv", ("fc",), KWARGS),
            ("save_kv_layer", ("layer.0", "kv", "attn"), KWARGS),
            ("start_load_kv", ("fc",), {}),
            ("save_kv_layer", ("layer.0", "kv", "attn"), {}),
        ]
    type(connector).save_kv_layer(connector, "layer.1", "kv", "attn", **KWARGS)
    type(connector).start_load_kv(connector, "fc1", **KWARGS)
    for sub in connector.sub_connectors:
        assert cast(RecordingConnector, sub).calls[-2:] == [
            ("save_kv_layer", ("layer.1", "kv", "attn"), KWARGS),
            ("start_load_kv", ("fc1",), KWARGS),
        ]


def test_the_kwargs_column_is_vllms() -> None:
    # The hooks whose vLLM method takes **kwargs are the ones the chain passes them on.
    takes = {
        name
        for name in HOOKS
        if hasattr(KVConnectorBase_V1, name)
        and any(
            p.kind is inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(getattr(KVConnectorBase_V1, name)).parameters.values()
        )
    }
    assert takes == set(hooks_where(passes_kwargs=True))


PER_LAYER_AND_STEP = [
    name
    for name in hooks_where(every=Every.LAYER) + hooks_where(every=Every.STEP)
    if name in ComposedConnector.__dict__ and name != "get_finished"
]


class _Recorder:
    """A chain that records the one call it gets (both halves' attributes at once)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> str:
            self.calls.append((name, args, kwargs))
            return f"{name} answered"

        return record


def _recording(connector: ComposedConnector) -> _Recorder:
    """The connector's half of the chain (and the chain) replaced by a :class:`_Recorder`."""
    recorder = _Recorder()
    connector.chain = connector.scheduler = connector.worker = recorder  # type: ignore[assignment]
    return recorder


@pytest.mark.parametrize("name", PER_LAYER_AND_STEP)
def test_the_methods_an_editor_follows_are_the_ones_vllm_calls(
    registered: None, name: str
) -> None:
    # Per layer and per step, vLLM calls the class's method, which calls its half's
    # method of the same name, kwargs included; or, for the worker's hot path (named
    # in WORKER_HOT_PATH), that method itself, bound in __init__.
    # (Built in the process that calls the hook: its half has the hook.)
    scheduler = HOOKS[name].process == "scheduler"
    role = KVConnectorRole.SCHEDULER if scheduler else KVConnectorRole.WORKER
    connector = composed([child(RecordingConnector)], role)
    if name in WORKER_HOT_PATH:
        assert getattr(connector, name) == getattr(connector.worker, name)
    else:
        assert name not in vars(connector)
    method = getattr(ComposedConnector, name)
    params = list(inspect.signature(method).parameters.values())[1:]
    args = tuple(f"arg-{p.name}" for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    kwargs = KWARGS if HOOKS[name].passes_kwargs else {}
    recorder = _recording(connector)
    answer = method(connector, *args, **kwargs)
    assert recorder.calls == [(name, args, kwargs)]
    returns = inspect.signature(getattr(NodeSpec, name)).return_annotation not in (None, "None")
    assert answer == (f"{name} answered" if returns else None)


def test_a_node_switched_off_is_gone_from_the_next_call(registered: None) -> None:
    connector = composed([child(RecordingConnector, tag=i) for i in range(2)])
    first, second = connector.sub_connectors
    connector.save_kv_layer("layer.0", "kv", "attn")  # the chain's dispatch, now cached
    connector.chain.switch_off(connector.chain.implemented("save_kv_layer")[0], "test")
    connector.save_kv_layer("layer.1", "kv", "attn")
    saves = [
        [args[0] for hook, args, _ in cast(RecordingConnector, sub).calls if hook == hook_name]
        for sub in (first, second)
        for hook_name in ("save_kv_layer",)
    ]
    assert saves == [["layer.0"], ["layer.0", "layer.1"]]


def test_several_memory_pools_are_refused_in_multiconnectors_words(registered: None) -> None:
    one = composed([child(RecordingConnector, pool="a"), child(RecordingConnector)])
    assert one.get_mem_pool_context() is not None
    two = composed([child(RecordingConnector, pool="a"), child(RecordingConnector, pool="b")])
    with pytest.raises(ValueError, match="Multiple connectors provide a KV cache memory pool"):
        two.get_mem_pool_context()


def test_inline_pipelines_keep_their_node_order(registered: None) -> None:
    # The file order is the default load order (MultiConnector's: config order).
    kinds = [RecordingHMAConnector, RecordingConnector, RecordingHMAConnector]
    connector = composed([child(k, tag=i) for i, k in enumerate(kinds)])
    assert connector.pipeline.load_order == tuple(node_ids([child(k) for k in kinds]))
    assert [type(c) for c in connector.sub_connectors] == kinds


def test_a_native_nodes_stats_leave_the_engine_able_to_be_rebuilt(registered: None) -> None:
    connector = composed([child(RecordingConnector), child(RecordingHMAConnector)])
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    # The scheduler's to_dict(), through vLLM's msgpack to the frontend process.
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded.scheduler_stats is not None
    rebuilt = ComposedConnector.build_kv_connector_stats(decoded.scheduler_stats.kv_connector_stats)
    assert rebuilt is not None
    for node_id in ("RecordingConnector", "RecordingHMAConnector"):
        own = rebuilt.data[node_id]["node"]
        assert type(own) is RecordedStats and own.data == {"moved": [1, 2]}
    assert rebuilt.reduce()["RecordingConnector"] == {"Moved": 3}


#: Hooks whose connector method does more than call the chain's (why, in its code):
#: the canonical view built, vLLM's default where no node answers, the model found.
NOT_ONLY_THE_CHAIN = {
    "initialize_worker_connector",
    "register_kv_caches",
    "unregister_kv_caches",
    "restore_kv_caches",
    "bind_kv_cache_manager",
}


@pytest.mark.parametrize("name", sorted(set(HOOKS) - NOT_ONLY_THE_CHAIN))
def test_each_hook_reaches_the_chains_method_of_its_name(registered: None, name: str) -> None:
    """One calling convention: vLLM's method of a hook calls the chain's method of
    the same name, with vLLM's arguments."""
    connector = composed([child(RecordingConnector)])
    method = getattr(ComposedConnector, name)
    params = list(inspect.signature(method).parameters.values())[1:]
    args = tuple(f"arg-{p.name}" for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    recorder = _recording(connector)
    method(connector, *args)
    assert [c[0] for c in recorder.calls] == [name]
    assert recorder.calls[0][1] == args


@pytest.mark.parametrize(
    "name", hooks_where(native=Native.DIRECT) + hooks_where(native=Native.ADAPTED)
)
def test_a_hook_the_vllm_node_converts_has_its_hookimpl(name: str) -> None:
    from composer.vllm.native import NativeConnectorNode

    impl = getattr(NativeConnectorNode, name, None)
    assert impl is not None and hasattr(impl, "kv_composer_impl"), name
