"""Chains without vLLM, for tests: a chain of any plugin types, a node that
implements every hook, and a driver.

:func:`pipeline_chain` builds a chain from a pipeline and the plugin types of a
test module; ``Scripted`` answers each hook from its config (``returns``),
records every call in ``CALLS`` and raises in the hook named ``fail_in``;
:func:`drive` calls a hook through the chain of its process the way vLLM calls
it; :func:`switched_off` reads who is off from the chain's stats report. Used by
the project's own tests (the chain, fault policies, the combine
table) and usable by a plugin's (``chain_for``, the two chains and ``NodeFailed``
are here for them).
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from composer.chain import ChainCore, ChainMetadata
from composer.chain import SchedulerChain as SchedulerChain  # (a plugin's tests build chains)
from composer.chain import WorkerChain as WorkerChain
from composer.chain import chain_for as chain_for
from composer.chain.faults import NodeFailed as NodeFailed  # (a plugin's tests expect it)
from composer.discovery import Registry, discover
from composer.hook_table import HOOKS, Combine, Process
from composer.hookspecs import NodeSpec, hookimpl
from composer.plugin import Plugin
from composer.plugin_types import Capabilities, PluginType, VllmProcess
from composer.ranges import Range as Range  # (a plugin's tests give request.loads)
from composer.validation import load_pipeline

#: (node id, hook) of every call a ``Scripted`` node received, in order.
CALLS: list[tuple[str, str]] = []
#: What a ``Scripted`` node returns for a hook its config does not script:
#: what the chain combines as "nothing".
NOTHING: dict[str, Any] = {
    "get_num_new_matched_tokens": (0, False),
    "request_finished": (False, None),
    "request_finished_all_groups": (False, None),
    "get_finished": (None, None),
    "get_block_ids_with_load_errors": set(),
    "take_events": [],
    "has_pending_block_frees": False,
    "has_pending_push_work": False,
    "register_finished_partial_tail": False,
}
KV_CACHE_CONFIG = SimpleNamespace(
    kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))]
)


def spec_hooks() -> list[str]:
    """Every lifecycle hook of the spec, sorted."""
    return sorted(HOOKS)


def processes_of(hook: str) -> tuple[VllmProcess, ...]:
    """The processes whose chain runs ``hook`` (its row's process; either: both)."""
    process = HOOKS[hook].process
    if process is Process.EITHER:
        return ("scheduler", "worker")
    return ("scheduler",) if process is Process.SCHEDULER else ("worker",)


class ScriptedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Hook -> what the node returns from it.
    returns: dict[str, Any] = Field(default_factory=dict)
    #: The hook the node raises in ("" for none).
    fail_in: str = ""


class Scripted(Plugin):
    """Implements every hook of the spec (but ``get_transfer_results``: nodes without
    it are asked ``get_finished``, as vLLM's are)."""

    def answer(self, hook: str) -> Any:
        CALLS.append((self.node_id, hook))
        if self.config.fail_in == hook:
            raise RuntimeError(f"boom in {hook}")
        return self.config.returns.get(hook, NOTHING.get(hook))


def _hookimpl_for(hook: str) -> Any:
    params = [p for p in inspect.signature(getattr(NodeSpec, hook)).parameters if p != "self"]
    # pluggy reads the argument names: the function gets the spec's own signature.
    namespace: dict[str, Any] = {}
    exec(  # noqa: S102 - builds a hookimpl with the spec's argument names
        f"def {hook}(self, {', '.join(params)}):\n    return self.answer({hook!r})", namespace
    )
    return hookimpl(namespace[hook])


for _hook in spec_hooks():
    if _hook != "get_transfer_results":
        setattr(Scripted, _hook, _hookimpl_for(_hook))


@hookimpl
def register_plugin_types(register: Any) -> None:
    register(
        PluginType(
            name="scripted",
            node=Scripted,
            config=ScriptedConfig,
            capabilities=Capabilities(hma=True),  # so request_finished_all_groups is called
        )
    )


class _Module:
    register_plugin_types = staticmethod(register_plugin_types)
    __name__ = "composer.testing.chains"


def registry(*modules: Any) -> Registry:
    """The built-in plugin types, ``scripted``, and those ``modules`` register
    (objects with a ``register_plugin_types`` hookimpl); no entry points."""
    return discover(extra=[_Module(), *modules], entry_points=False)


def pipeline_chain(
    pipeline: dict[str, Any], role: VllmProcess = "scheduler", *, types: Registry | None = None
) -> SchedulerChain | WorkerChain:
    """The chain of ``pipeline`` (a pipeline file's data) in one vLLM process, without
    vLLM: one KV cache group of 4-token blocks. ``CALLS`` is cleared."""
    CALLS.clear()
    # A scripted answer may be any Python object (a set, an event), which a pipeline,
    # being data, may not hold: validate without them, then hand them to the configs.
    answers: dict[str, dict[str, Any]] = {}
    nodes: dict[str, Any] = {}
    for node_id, node in pipeline.get("nodes", {}).items():
        if node.get("plugin") == "scripted" and "returns" in node.get("config", {}):
            config = dict(node["config"])
            answers[node_id] = config.pop("returns")
            node = {**node, "config": config}
        nodes[node_id] = node
    resolved = load_pipeline(
        {"version": 1, **pipeline, "nodes": nodes}, registry=types or registry()
    )
    for node in resolved.nodes:
        if node.id in answers:
            node.config.returns = answers[node.id]  # type: ignore[attr-defined]
    return chain_for(resolved, role, kv_cache_config=KV_CACHE_CONFIG)


def chain(
    nodes: dict[str, dict[str, Any]], role: VllmProcess = "scheduler", **settings: Any
) -> SchedulerChain | WorkerChain:
    """A chain of ``scripted`` nodes: node id -> its ``ScriptedConfig`` fields (plus
    ``on_error``); ``settings`` are pipeline settings (``load_policy``, ...)."""
    CALLS.clear()
    spec = {
        node_id: {
            "plugin": "scripted",
            "config": {k: v for k, v in fields.items() if k != "on_error"},
            **({"on_error": fields["on_error"]} if "on_error" in fields else {}),
        }
        for node_id, fields in nodes.items()
    }
    return pipeline_chain({"nodes": spec, **settings}, role)


def request(rid: str = "r1") -> Any:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(20)),
        num_tokens=20,
        num_prompt_tokens=20,
        num_preemptions=0,
    )


#: Two KV cache groups of 4-token blocks (vLLM's hybrid manager): a sliding
#: window's, then full attention's.
HYBRID_KV_CACHE_CONFIG = SimpleNamespace(
    kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4)),
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4)),
    ]
)


class Blocks:
    """vLLM's ``KVCacheBlocks``, as far as the chain reads it: block ids per KV cache
    group (one group, 10..14, by default; block 0 is vLLM's null block)."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups or ([10, 11, 12, 13, 14],)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(self.groups)


def connector_output(
    invalid: Collection[int] = frozenset(), failed: Collection[str] = frozenset()
) -> Any:
    """vLLM's ``KVConnectorOutput`` for ``update_connector_output``, as far as the
    chain reads it: the blocks that failed to load, the async loads that failed."""
    return SimpleNamespace(
        invalid_block_ids=set(invalid), failed_recving=set(failed), kv_connector_worker_meta=None
    )


def metadata(**fields: Any) -> ChainMetadata:
    return ChainMetadata(**{"per_node": {}, "loads": {}, **fields})


def async_load(node: str, blocks: Collection[int], reported_by_chain: bool = False) -> Range:
    """One range of an async load, as the scheduler sends it to the workers."""
    return Range(node, 0, len(blocks), True, (tuple(blocks),), reported_by_chain)


def async_loads(meta: ChainMetadata) -> dict[str, tuple[tuple[str, frozenset[int], bool], ...]]:
    """The step's async loads, per request: (node, blocks, whether the chain reports
    the node's sync load done) per range."""
    return {
        rid: tuple((r.node, r.block_ids(), r.reported_by_chain) for r in ranges)
        for rid, ranges in (meta.async_loads or {}).items()
    }


def sample_args(req: Any) -> dict[str, tuple[Any, ...]]:
    """vLLM's arguments to each hook, as the chain's method of that name takes them
    (fresh objects each call: the chain keeps some)."""
    step = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set())
    loading = metadata(loads={"bad": {10, 11}})
    return {
        "initialize_worker_connector": (None, None, None),
        "get_mem_pool_context": (),
        "register_kv_caches": (None, {}),
        "set_host_xfer_buffer_ops": (None,),
        "get_handshake_metadata": (),
        "unregister_kv_caches": (),
        "restore_kv_caches": (None, {}),
        "bind_kv_cache_manager": (None,),
        "bind_gpu_block_pool": (None,),
        "on_new_request": (req,),
        "get_num_new_matched_tokens": (req, 0),
        "update_state_after_alloc": (req, Blocks(), 8),
        "get_loaded_kv_cache_group_ids": (req,),
        "get_external_cache_hit_sources": (req, 8),
        "build_connector_meta": (step,),
        "update_connector_output": (SimpleNamespace(kv_connector_worker_meta=None),),
        "request_finished": (req, [10, 11]),
        "request_finished_all_groups": (req, ([10],)),
        "register_finished_partial_tail": (req, [10], None),
        "take_events": (),
        "has_pending_block_frees": (),
        "has_pending_push_work": (),
        "get_finished_count": (),
        "set_xfer_handshake_metadata": ({},),
        "set_xfer_handshake_metadata_pp_aware": ({},),
        "reset_cache": (),
        "handle_preemptions": (loading,),
        "bind_connector_metadata": (loading,),
        "start_load_kv": (None,),
        "wait_for_layer_load": ("layer0",),
        "save_kv_layer": ("layer0", None, None),
        "wait_for_save": (),
        "finish_forward": (),
        "reset_capture_state": (),
        "clear_connector_metadata": (),
        "get_finished": (set(),),
        "get_transfer_results": (set(),),
        "get_block_ids_with_load_errors": (),
        "build_connector_worker_meta": (),
        "get_kv_connector_stats": (),
        "get_kv_connector_kv_cache_events": (),
        "shutdown": (),
    }


def drive(chain: ChainCore, hook: str, req: Any = None) -> Any:
    """Call ``hook`` through ``chain`` as vLLM calls it (the chain's method of the hook's
    name, with :func:`sample_args`); the chain's answer. ``chain`` is of a process that
    runs the hook (:func:`processes_of`). A hook asked of the node serving the
    request (``Combine.CHOSEN_NODE``) follows the lookup that chooses it."""
    req = req if req is not None else request()
    args = sample_args(req)
    if hook not in args:
        raise KeyError(f"sample_args() has no arguments for {hook!r}: add them to its table")
    if chain.process not in processes_of(hook):
        raise ValueError(
            f"{hook} runs in the {HOOKS[hook].process}, not the {chain.process}: "
            "drive it through a chain of its process (processes_of)"
        )
    combine = HOOKS[hook].combine
    if combine is Combine.CHOSEN_NODE:
        assert isinstance(chain, SchedulerChain)
        chain.get_num_new_matched_tokens(req, 0)
    out = getattr(chain, hook)(*args[hook])
    return list(out) if combine is Combine.CONCATENATE else out


def switched_off(report: Any) -> set[str]:
    """The nodes a stats report says are switched off (``disabled`` in their counters).

    ``report`` is what the chain's ``take_stats`` or vLLM's ``get_kv_connector_stats``
    returns (the latter's ``data``; None: nothing reported). A node is in a report
    only when something of it was counted since the last one, as a fault or the
    shutdown that switching it off runs is; taking the report resets the counters."""
    data = getattr(report, "data", report) or {}
    return {node for node, entry in data.items() if entry["counters"].get("disabled")}
