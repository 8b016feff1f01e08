"""Per-node counters, reported through vLLM's connector stats under each node id."""

from __future__ import annotations

from collections import UserDict
from dataclasses import dataclass, field, fields


class Changes:
    """Set by any write to the counters of the nodes that share it.

    A chain's nodes share one, so that the per-step report costs a single check
    on the usual step where nothing was counted; the report clears it.
    """

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False


class Counters(UserDict[str, float]):
    """Named counters of a node (``stats.extra``); every write marks the node changed.

    A UserDict rather than a dict subclass: every way of writing (``[k] = v``,
    ``update``, ``setdefault``, ``add``) goes through ``__setitem__``.
    """

    def __init__(self, changes: Changes) -> None:
        self.changes = changes
        super().__init__()

    def __setitem__(self, key: str, value: float) -> None:
        self.data[key] = value
        self.changes.seen = True

    def __delitem__(self, key: str) -> None:
        del self.data[key]
        self.changes.seen = True

    def add(self, key: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``key`` (starting from 0)."""
        self[key] = self.data.get(key, 0) + amount


class Gauges(Counters):
    """Current values (pool use, a server's chunk size): kept across reports.

    Reported with the node's counters, latest value winning when steps or
    workers are combined (counters are summed). Setting the value a gauge
    already has is not a change.
    """

    #: Some gauge changed since the node's last report.
    changed = False

    def __setitem__(self, key: str, value: float) -> None:
        if key not in self.data or self.data[key] != value:
            self.data[key] = value
            self.changed = self.changes.seen = True


class Labels(UserDict[str, str]):
    """Text a node reports about itself (``stats.policies["eviction"] = "arc"``): kept across
    reports, the latest winning, as :class:`Gauges`; writing the text a key already has
    is not a change."""

    #: Some label changed since the node's last report.
    changed = False

    def __init__(self, changes: Changes) -> None:
        self.changes = changes
        super().__init__()

    def __setitem__(self, key: str, value: str) -> None:
        if self.data.get(key) != value:
            self.data[key] = value
            self.changed = self.changes.seen = True

    def __delitem__(self, key: str) -> None:
        del self.data[key]
        self.changed = self.changes.seen = True


@dataclass(eq=False)
class NodeStats:
    """A node's counters since the last report (``self.stats`` of a plugin).

    Plugins add to the fields (``self.stats.tokens_loaded += n``), count their
    own events in ``extra`` (``self.stats.extra.add("evictions")``) and set
    current values in ``gauges`` (``self.stats.gauges["pool_use"] = 0.3``).
    """

    #: Shared by a chain's nodes; first, so that every later write can mark it.
    changes: Changes = field(default_factory=Changes, repr=False)
    #: Calls of the node's lookup; vLLM asks again for a request it could not
    #: schedule yet, so one request may count several times here.
    lookups: int = 0
    hits: int = 0
    #: Requests looked up in the node, each counted once (:meth:`count_request`),
    #: and their prompt tokens; of those, the requests the node served tokens of,
    #: and the tokens it served. The hit rates users read are
    #: ``requests_hit / requests_looked_up`` and
    #: ``prompt_tokens_hit / prompt_tokens_looked_up``.
    requests_looked_up: int = 0
    requests_hit: int = 0
    prompt_tokens_looked_up: int = 0
    prompt_tokens_hit: int = 0
    tokens_hit: int = 0
    tokens_loaded: int = 0
    tokens_saved: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    errors: int = 0
    #: Hook -> calls that found the node's store away (it raised ``Unavailable``):
    #: misses, skipped saves, recomputed loads; not errors.
    unavailable: dict[str, int] = field(default_factory=dict)
    disabled: bool = False
    hook_seconds: dict[str, float] = field(default_factory=dict)
    #: Plugin-specific counters (evictions, bytes copied, ...): summed, reset by each report.
    extra: Counters = field(init=False)
    #: Plugin-specific current values (pool use, ...): the latest wins, kept across reports.
    gauges: Gauges = field(init=False)
    #: Per-tenant counters, keyed ``"<counter>:<tenant>"`` (:meth:`tenant_add`), summed
    #: as ``extra``; the tenant is vLLM's ``cache_salt`` as the node's quotas name it.
    tenants: Counters = field(init=False)
    #: Per-tenant current values, keyed ``"<gauge>:<tenant>"``, kept as ``gauges``.
    tenant_gauges: Gauges = field(init=False)
    #: The cache policy in force of each kind (``eviction``: ``arc``, or
    #: ``lfu → lru after 1,203 evictions`` once it raised and was switched off), for a
    #: node that has cache policies; kept as ``gauges``.
    policies: Labels = field(init=False)

    def __post_init__(self) -> None:
        self.extra = Counters(self.changes)
        self.gauges = Gauges(self.changes)
        self.tenants = Counters(self.changes)
        self.tenant_gauges = Gauges(self.changes)
        self.policies = Labels(self.changes)

    def tenant_add(self, key: str, tenant: str, amount: float = 1) -> None:
        """Add ``amount`` to ``tenant``'s counter ``key`` (``blocks_evicted``, ...)."""
        self.tenants.add(f"{key}:{tenant}", amount)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        self.changes.seen = True

    def count_request(self, prompt_tokens: int, served_tokens: int = 0) -> None:
        """One request looked up in the node, with ``prompt_tokens``, of which the node
        served ``served_tokens`` (0: none, or not known yet). The chain calls it once
        per request, at its admission, and :meth:`count_served` once it finishes."""
        self.requests_looked_up += 1
        self.prompt_tokens_looked_up += prompt_tokens
        if served_tokens > 0:
            self.count_served(served_tokens)

    def count_served(self, tokens: int) -> None:
        """A request the node served ``tokens`` of (that arrived in vLLM's KV cache)."""
        self.requests_hit += 1
        self.prompt_tokens_hit += tokens

    def add_time(self, hook: str, seconds: float) -> None:
        self.hook_seconds[hook] = self.hook_seconds.get(hook, 0.0) + seconds
        self.changes.seen = True

    def take(self) -> dict[str, object]:
        """The counters since the last call, as plain data; resets them (not ``disabled``)."""
        snapshot: dict[str, object] = {}
        for f in fields(self):
            if f.name == "changes":
                continue
            value = getattr(self, f.name)
            mapping = isinstance(value, dict | UserDict)
            snapshot[f.name] = dict(value) if mapping else value
            if f.name not in ("disabled", *KEPT):
                # A reset is not a change: object.__setattr__ leaves ``changes`` alone.
                object.__setattr__(self, f.name, {} if mapping else 0)
        object.__setattr__(self, "extra", Counters(self.changes))
        object.__setattr__(self, "tenants", Counters(self.changes))
        self.gauges.changed = self.tenant_gauges.changed = self.policies.changed = False
        return snapshot

    def is_empty(self) -> bool:
        """Nothing to report: no count, no gauge changed, and not switched off (a node
        switched off on the other process's word may count nothing, yet its state
        must reach the report and the ``disabled`` metric)."""
        return not any(
            (
                self.disabled,
                self.lookups,
                self.requests_looked_up,
                self.tokens_loaded,
                self.tokens_saved,
                self.errors,
                self.unavailable,
                self.hook_seconds,
                self.extra,
                self.gauges.changed,
                self.tenants,
                self.tenant_gauges.changed,
                self.policies.changed,
            )
        )


#: The snapshot keys that hold current values (the latest wins), not counts.
KEPT = ("gauges", "tenant_gauges", "policies")


def split_tenant(key: str) -> tuple[str, str]:
    """``"<counter>:<tenant>"`` as (counter, tenant): a tenant may hold ``:``, a counter not."""
    name, _, tenant = key.partition(":")
    return name, tenant


def merge(a: dict[str, object], b: dict[str, object]) -> dict[str, object]:
    """Add two snapshots of the same node (from two steps or two workers); ``b`` is the later."""
    out: dict[str, object] = dict(a)
    for key, value in b.items():
        old = out.get(key)
        if key in KEPT and isinstance(value, dict):
            out[key] = {**old, **value} if isinstance(old, dict) else dict(value)
        elif isinstance(value, dict):
            merged = dict(old) if isinstance(old, dict) else {}
            for k, v in value.items():
                merged[k] = merged.get(k, 0) + v
            out[key] = merged
        elif isinstance(value, bool):
            out[key] = bool(old) or value
        elif isinstance(value, int | float) and isinstance(old, int | float):
            out[key] = old + value
        else:
            out[key] = value
    return out


def zeroed(counters: dict[str, object]) -> dict[str, object]:
    """A snapshot with every count at zero; states (``disabled``) and gauges' shape kept."""
    out: dict[str, object] = {}
    for key, value in counters.items():
        if isinstance(value, bool):
            out[key] = value  # a state (disabled), not a count
        elif isinstance(value, int | float):
            out[key] = type(value)(0)
        elif isinstance(value, dict):
            out[key] = {}
        else:
            out[key] = value
    return out


def counters_empty(counters: dict[str, object]) -> bool:
    """No count in the snapshot is non-zero (states such as ``disabled`` do not count)."""
    for value in counters.values():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float | dict) and value:
            return False
    return True


def flatten(node_id: str, counters: dict[str, object]) -> dict[str, float | str]:
    """A snapshot as ``{"node.key": n, "node.key.sub": n}``, as the stat logger prints it.

    Zero counts and states are left out; mapping entries (hook seconds, extra,
    gauges, and the text of ``policies``) are all kept.
    """
    out: dict[str, float | str] = {}
    for key, value in counters.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float) and value:
            out[f"{node_id}.{key}"] = value
        elif isinstance(value, dict):
            for sub, v in value.items():
                out[f"{node_id}.{key}.{sub}"] = v
    return out
