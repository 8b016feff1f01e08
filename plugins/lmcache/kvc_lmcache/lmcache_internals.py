"""Every place the plugin reaches past LMCache's public API, in one module.

Written against ``lmcache==0.5.6`` (the version this package pins). Each reach
is guarded: on another LMCache layout it finds nothing, and the plugin falls
back to LMCache's own behaviour (validation leaves the check to LMCache; the
server node waits for LMCache's heartbeat and ``mq_timeout``) instead of
failing. On an LMCache upgrade this module is what to check, with the tests
that compare its readings with LMCache's own (``test_lmcache_config``,
``test_lmcache_l2_config``, ``test_lmcache_watch``).

**Its source**, read with :mod:`ast` rather than imported: ``import lmcache``
imports torch (~5 s), and ``kvc validate`` must stay light.

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
import importlib.util
import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

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
