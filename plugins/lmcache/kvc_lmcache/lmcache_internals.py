"""Every place the plugin reaches past LMCache's public API, in one module.

Written against ``lmcache==0.5.6`` (:data:`TESTED`, the releases this package
is tested with). LMCache changes these between releases, so they are checked
before they are used (:data:`REACHES`, :func:`reach_problems`): at engine start
a node whose mode reaches one that is missing or of another shape refuses to
start, naming it (``kvc validate --deep`` says the same, located at the node),
and a release outside :data:`TESTED` is named in one warning
(:func:`refuse_unknown_lmcache`). Each reach is also guarded where it is used:
on another layout it finds nothing, and the plugin falls back to LMCache's own
behaviour rather than failing mid-request. On an LMCache upgrade this module
is what to check, with the tests that compare its readings with LMCache's own
(``test_lmcache_config``, ``test_lmcache_l2_config``, ``test_lmcache_watch``,
``test_lmcache_contract``).

**Its source**, read with :mod:`ast` rather than imported: ``import lmcache``
imports torch (seconds, the README says), and ``kvc validate`` must stay light.

* :func:`source_dir`: where the ``lmcache`` package is (``find_spec``, which
  imports nothing).
* :func:`lmcache_field_names`: the keys of ``_CONFIG_DEFINITIONS`` and
  ``_CONFIG_ALIASES`` in ``lmcache/v1/config.py``, the engine config's fields.
  LMCache's ``from_dict`` ignores unknown keys, so this is what stops a typo
  in the in-process node's ``extra``.
* :func:`adapter_fields`: the ``register_l2_adapter_type("name", Class)``
  calls in ``lmcache/v1/distributed/l2_adapters`` and the keys each config
  class's ``from_dict`` / ``help`` reads: LMCache has no table of its L2
  adapters that can be read without importing it.

**Its MP connector at run time** (``LMCacheMPConnector``'s ``worker_adapter``
and ``scheduler_adapter``, in ``lmcache/integration/vllm/
vllm_multi_process_adapter.py``), so that a dead server costs the server node
about one watcher probe instead of LMCache's heartbeat interval or
``mq_timeout``:

* ``_health_events`` (per server url) / ``_health_event``: cleared, they are
  LMCache's own degraded mode (no lookups, retrieves dropped and reported
  failed, stores dropped), which its heartbeat enters only after up to twice
  its interval. :func:`degrade` enters it at once; ``is_healthy`` (public)
  tells when LMCache has left it (:func:`lmcache_healthy`).
* ``_ensure_heartbeat_started``: LMCache starts its heartbeat lazily, and only
  the heartbeat leaves degraded mode: :func:`degrade` makes sure it runs.
* ``_heartbeats`` / ``_heartbeat`` (``PeriodicThread.wake``): woken by
  :func:`wake_heartbeats` when the server answers again, so LMCache
  re-registers at once rather than at its next interval.
* ``req_clients`` / ``req_client``, their ``_message_queue_client`` and its
  ``pending_futures``, and ``LMCacheTimeoutError``: :func:`fail_pending` ends
  each wait on an unanswered request as its ``mq_timeout`` would, now. LMCache
  polls a lookup's ack, and waits for a store or retrieve, until then.
* ``_mq_timeout`` and each client's zmq ``socket``: :func:`quiet` makes the
  connector's shutdown skip a dead server (no unregistration wait, no socket
  lingering on unsent messages), so the engine's process exits.

:func:`step_metadata` reads the step's connector metadata through vLLM's
private ``_get_connector_metadata`` (LMCache's connector inherits it and
keeps no count of what it loads; see :mod:`kvc_lmcache.loads`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import re
import textwrap
import threading
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

#: The LMCache releases this package is tested with (README's table says the same).
TESTED = ("0.5.6",)

Mode = Literal["server", "in_process"]


class LMCacheIncompatible(RuntimeError):
    """The installed LMCache lacks something the node reaches: it refuses to start."""


def lmcache_version() -> str | None:
    """The installed LMCache release (None: not installed)."""
    try:
        return metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return None


def untested_release() -> str:
    """One line naming an installed LMCache release outside :data:`TESTED` ("": none)."""
    version = lmcache_version()
    if version is None or version in TESTED:
        return ""
    return (
        f"LMCache {version} is installed; the lmcache node is tested with LMCache "
        f"{', '.join(TESTED)} (the internals it reaches were checked and are present)"
    )


# -- what the node reaches, checked before it is used ----------------------------- #


@dataclass(frozen=True)
class Reach:
    """A class or function of LMCache's (or vLLM's) the node uses beyond a public API,
    and what of it: methods (with the arguments the node passes, by position),
    attributes its instances get (``self.x = ...`` anywhere in its source; ``a|b``:
    either), or, for a function, its arguments."""

    where: str  # "module:QualName"
    modes: tuple[Mode, ...]
    methods: tuple[tuple[str, int], ...] = ()
    attributes: tuple[str, ...] = ()
    why: str = ""


_IMPL = "lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl"
_MP = "lmcache.integration.vllm.vllm_multi_process_adapter:"

REACHES: tuple[Reach, ...] = (
    Reach(
        _IMPL,
        ("in_process",),
        methods=(
            ("__init__", 3),  # (vllm_config, role, parent)
            ("get_num_new_matched_tokens", 2),
            ("update_state_after_alloc", 2),  # (request, num_external_tokens)
            ("build_connector_meta", 1),
            ("request_finished", 2),
            ("register_kv_caches", 1),
            ("start_load_kv", 1),
            ("wait_for_layer_load", 1),
            ("save_kv_layer", 3),
            ("wait_for_save", 0),
            ("get_finished", 1),
            ("get_block_ids_with_load_errors", 0),
            ("shutdown", 0),
        ),
        attributes=("_manager", "lookup_client"),
        why="the in-process node drives it as vLLM's LMCacheConnectorV1 does",
    ),
    Reach(
        "lmcache.v1.manager:LMCacheManager",
        ("in_process",),
        attributes=("_init_failed", "_init_failed_reason"),
        why="whether LMCache runs degraded, and why (said at engine start)",
    ),
    Reach(
        "lmcache.integration.vllm.utils:extract_request_configs_from_sampling_params",
        ("in_process",),
        methods=(("__call__", 1),),
        why="a request's lmcache.* kv_transfer_params become its request configs (the "
        "tenant's tag)",
    ),
    Reach(
        "lmcache.utils:CacheEngineKey",
        ("in_process",),
        attributes=("tags",),
        why="lmcache.tag.* request configs are part of every key (tenants apart)",
    ),
    Reach(
        _MP + "LMCacheMPSchedulerAdapter",
        ("server",),
        methods=(("_ensure_heartbeat_started", 0),),
        attributes=("_health_events", "_heartbeats", "is_healthy", "req_clients", "_mq_timeout"),
        why="a dead server: LMCache's degraded mode entered at once, its waits ended",
    ),
    Reach(
        _MP + "LMCacheMPWorkerAdapter",
        ("server",),
        methods=(("_ensure_heartbeat_started", 0),),
        attributes=("_health_event", "_heartbeat", "is_healthy", "req_client", "_mq_timeout"),
        why="a dead server: LMCache's degraded mode entered at once, its waits ended",
    ),
    Reach(
        "lmcache.v1.multiprocess.transport.zmq_impl.client:ZmqMultiprocessClient",
        ("server",),
        attributes=("_message_queue_client",),
        why="the message queue whose pending requests a dead server's outage ends",
    ),
    Reach(
        "lmcache.v1.multiprocess.transport.zmq_impl.mq:MessageQueueClient",
        ("server",),
        attributes=("pending_futures", "socket"),
        why="pending requests ended and sockets closed when the server is dead",
    ),
    Reach(
        "lmcache.v1.mp_observability.errors:LMCacheTimeoutError",
        ("server",),
        why="the error a wait on a dead server ends with, as its mq_timeout would",
    ),
    Reach(
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1",
        ("server",),
        methods=(("_get_connector_metadata", 0),),
        why="the step's metadata, to count the tokens LMCache loaded",
    ),
)


def _resolve(where: str) -> Any:
    module, _, qualname = where.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _assigned(cls: type) -> set[str]:
    """Attributes set on ``self`` anywhere in ``cls``'s source (and its bases')."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            targets = node.targets if isinstance(node, ast.Assign) else [target]
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    names.add(t.attr)
    return names


def _positional(fn: Any) -> int | None:
    """How many arguments ``fn`` takes by position (less ``self``); None: any number."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    n = sum(1 for p in params if p.kind in kinds)
    return n - 1 if params and params[0].name == "self" else n


def _required(fn: Any) -> int:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 0
    n = sum(
        1
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )
    return n - 1 if params and params[0].name == "self" else n


def check_reach(reach: Reach) -> list[str]:
    """What is missing of ``reach``, or of another shape, in the installed release."""
    try:
        obj = _resolve(reach.where)
    except Exception as exc:  # ImportError, AttributeError, or the module raising
        return [f"{reach.where} is not there ({type(exc).__name__}: {exc})"]
    out = []
    for name, args in reach.methods:
        fn = obj if name == "__call__" and not isinstance(obj, type) else getattr(obj, name, None)
        label = reach.where if name == "__call__" else f"{reach.where}.{name}"
        if not callable(fn):
            out.append(f"{label} is not there")
            continue
        most, least = _positional(fn), _required(fn)
        if least > args or (most is not None and most < args):
            out.append(
                f"{label} takes {least} to {most if most is not None else 'any'} arguments; "
                f"the node passes {args}"
            )
    if reach.attributes and isinstance(obj, type):
        assigned = _assigned(obj)
        for name in reach.attributes:
            if name not in assigned and not hasattr(obj, name):
                out.append(f"{reach.where} has no attribute {name}")
    return [f"{m} ({reach.why})" if reach.why else m for m in out]


def reach_problems(mode: Mode) -> list[str]:
    """Every reach of ``mode`` that the installed LMCache (and vLLM) lack; empty: none."""
    if lmcache_version() is None:
        return ["LMCache is not installed (pip install lmcache)"]
    return [m for r in REACHES if mode in r.modes for m in check_reach(r)]


def launch_problems(mode: Mode) -> list[str]:
    """:func:`reach_problems` as ``kvc validate --deep`` says them (a node's
    ``launch_problems``)."""
    tested = ", ".join(TESTED)
    return [
        f"the installed LMCache {lmcache_version()} (tested: {tested}) lacks what mode "
        f"{mode} reaches: {problem}"
        for problem in reach_problems(mode)
    ]


_warned: list[str] = []


def refuse_unknown_lmcache(node_id: str, mode: Mode) -> None:
    """At a node's start: name an untested LMCache release once per process; refuse the
    node (:class:`LMCacheIncompatible`) when something it reaches is not there."""
    line = untested_release()
    if line and not _warned:
        import structlog  # (as the nodes log: this module is also imported by validation)

        structlog.get_logger("kv_composer").warning(line, node=node_id)
        _warned.append(line)
    problems = reach_problems(mode)
    if problems:
        raise LMCacheIncompatible(
            f'lmcache node "{node_id}" ({mode}) cannot run on the installed LMCache '
            f"{lmcache_version()}: "
            + "; ".join(problems)
            + f". It is tested with LMCache {', '.join(TESTED)}: install that release."
        )


def init_failure(impl: Any) -> str:
    """Why LMCache's in-process connector runs degraded, its last line ("": it does not).

    LMCache 0.5.6's ``LMCacheManager`` catches a failure to build its engine or
    lookup client (and its engine's ``post_init``), logs the traceback and runs
    degraded: no lookups, loads or saves."""
    manager = getattr(impl, "_manager", None)
    if not getattr(manager, "_init_failed", False):
        return ""
    reason = str(getattr(manager, "_init_failed_reason", "") or "").strip()
    lines = [line for line in reason.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no reason given"


# -- its source ------------------------------------------------------------------ #


def source_dir() -> Path | None:
    """The installed ``lmcache`` package's folder, found without importing it; None
    when LMCache is not installed (or is not a plain package folder)."""
    try:
        spec = importlib.util.find_spec("lmcache")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def lmcache_field_names() -> frozenset[str] | None:
    """Names LMCache's engine config accepts (incl. deprecated aliases), read without importing
    LMCache; None when LMCache is not installed or its source has another shape."""
    folder = source_dir()
    if folder is None:
        return None
    try:
        tree = ast.parse((folder / "v1" / "config.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    names: set[str] = set()
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            first = node.targets[0]
            target, value = (first.id if isinstance(first, ast.Name) else None), node.value
        if target in ("_CONFIG_DEFINITIONS", "_CONFIG_ALIASES") and isinstance(value, ast.Dict):
            names.update(
                k.value
                for k in value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            )
    # Fewer than a handful means the table moved: do not guess, leave it to the deep check.
    return frozenset(names) if len(names) > 20 else None


@lru_cache(maxsize=1)
def adapter_fields() -> dict[str, frozenset[str]] | None:
    """Each L2 adapter type LMCache registers, with the JSON keys its config reads.

    From ``register_l2_adapter_type("name", Class)`` calls and the string
    keys in ``Class.from_dict`` / ``Class.help`` of each module in
    ``lmcache/v1/distributed/l2_adapters``. None without LMCache (or when its
    source has another shape).
    """
    folder = source_dir()
    if folder is None:
        return None
    table: dict[str, frozenset[str]] = {}
    for file in sorted((folder / "v1/distributed/l2_adapters").glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "register_l2_adapter_type"
                and len(node.args) == 2
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and isinstance(node.args[1], ast.Name)
            ):
                continue
            cls = classes.get(node.args[1].id)
            table[node.args[0].value] = _class_keys(cls) if cls else frozenset()
    return table if len(table) >= 3 else None


_KEY = re.compile(r"^[a-z][a-z0-9_]*$")
_HELP_KEY = re.compile(r"^\s*-\s*([a-z][a-z0-9_]*)\b", re.MULTILINE)


def _class_keys(cls: ast.ClassDef) -> frozenset[str]:
    keys: set[str] = set()
    for item in cls.body:
        if not isinstance(item, ast.FunctionDef):
            continue
        if item.name == "from_dict":
            keys.update(
                n.value
                for n in ast.walk(item)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and _KEY.match(n.value)
            )
        elif item.name == "help":
            text = "".join(
                n.value
                for n in ast.walk(item)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            )
            keys.update(_HELP_KEY.findall(text))
    return frozenset(keys)


# -- its MP connector's adapters --------------------------------------------------- #


def _adapters(connector: Any) -> list[Any]:
    return [
        a
        for a in (
            getattr(connector, "worker_adapter", None),
            getattr(connector, "scheduler_adapter", None),
        )
        if a is not None
    ]


def _health_events(adapter: Any) -> list[threading.Event]:
    events = list((getattr(adapter, "_health_events", None) or {}).values())
    single = getattr(adapter, "_health_event", None)
    if single is not None:
        events.append(single)
    return [e for e in events if isinstance(e, threading.Event)]


def _clients(adapter: Any) -> list[Any]:
    clients = list((getattr(adapter, "req_clients", None) or {}).values())
    single = getattr(adapter, "req_client", None)
    if single is not None:
        clients.append(single)
    return [getattr(c, "_message_queue_client", c) for c in clients]


def degrade(connector: Any) -> None:
    """Enter LMCache's own degraded mode now, as its heartbeat would after up to twice
    its interval."""
    for adapter in _adapters(connector):
        for event in _health_events(adapter):
            event.clear()
        # Its heartbeat (started lazily) is what brings it back.
        start = getattr(adapter, "_ensure_heartbeat_started", None)
        if callable(start):
            with contextlib.suppress(Exception):
                start()


def wake_heartbeats(connector: Any) -> None:
    """Run LMCache's heartbeats now (``PeriodicThread.wake``, safe from any thread):
    the server answers again, so the next request need not wait out their interval."""
    for adapter in _adapters(connector):
        threads = list((getattr(adapter, "_heartbeats", None) or {}).values())
        threads.append(getattr(adapter, "_heartbeat", None))
        for thread in threads:
            wake = getattr(thread, "wake", None)
            if callable(wake):
                with contextlib.suppress(Exception):
                    wake()


def lmcache_healthy(connector: Any) -> bool:
    """Whether LMCache is out of its degraded mode (each adapter's ``is_healthy``)."""
    return all(bool(getattr(a, "is_healthy", True)) for a in _adapters(connector))


def fail_pending(connector: Any, url: str) -> None:
    """End every wait on an unanswered request now, as its mq_timeout would."""
    try:
        from lmcache.v1.mp_observability.errors import LMCacheTimeoutError

        error: type[TimeoutError] = LMCacheTimeoutError
    except ImportError:  # pragma: no cover - another LMCache layout
        error = TimeoutError
    for adapter in _adapters(connector):
        for client in _clients(adapter):
            pending = getattr(client, "pending_futures", None)
            if not pending:
                continue
            for _ in range(3):
                try:
                    entries = list(pending.values())
                    break
                except RuntimeError:  # changed size under the polling thread
                    continue
            else:
                continue
            for entry in entries:
                future = entry[0] if isinstance(entry, tuple) else entry
                if hasattr(future, "query") and not future.query():
                    with contextlib.suppress(Exception):
                        future.set_exception(error(f"the LMCache server at {url} is down"))


def quiet(connector: Any) -> None:
    """Make LMCache's shutdown skip a dead server: no waits, no lingering sockets."""
    import zmq

    for adapter in _adapters(connector):
        if hasattr(adapter, "_mq_timeout"):
            adapter._mq_timeout = 0.0
        for event in _health_events(adapter):
            event.clear()
        for client in _clients(adapter):
            sock = getattr(client, "socket", None)
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.setsockopt(zmq.LINGER, 0)
    fail_pending(connector, "(shutting down)")


def step_metadata(connector: Any) -> Any:
    """The connector metadata bound for this step; None when none is bound (vLLM's
    ``_get_connector_metadata`` asserts then)."""
    try:
        return connector._get_connector_metadata()
    except AssertionError:
        return None
