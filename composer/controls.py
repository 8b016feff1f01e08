"""Per-request tier controls, read from a request's ``kv_transfer_params``.

The names are vLLM's offloading connector's, with node ids for its tier matchers:

* ``kv_load_tiers``: the nodes the request may load from (``[]``: none);
* ``kv_store_tiers``: the nodes that may save its blocks (``[]``: none);
* ``max_offload_tokens``: how many of its first tokens a node may save;
* ``kv_retention``: how long the tiers keep its blocks, ``{ttl_s, pin, priority}``
  (:class:`Retention`; honoured by a tier's retention policy, see
  :mod:`composer.policy`).

Loads are the chain's to restrict (it asks only the allowed nodes); saves are
each saving node's, through :meth:`RequestView.store_limit
<composer.views.RequestView.store_limit>` (``offload-cpu`` honours it; a native
vLLM connector reads ``kv_transfer_params`` its own way). Bad controls are
never ignored, and never stop anything: a name that is no node matches no node
(a misspelled tier is not loaded from or saved to), malformed controls load
from and save to no node, and the error comes back in the request's
``kv_transfer_params`` (``{"kv_composer": {"error": ...}}``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

LOAD_TIERS = "kv_load_tiers"
STORE_TIERS = "kv_store_tiers"
MAX_OFFLOAD_TOKENS = "max_offload_tokens"
RETENTION = "kv_retention"
KEYS = (LOAD_TIERS, STORE_TIERS, MAX_OFFLOAD_TOKENS, RETENTION)
#: The longest ``ttl_s`` a request may ask (a day): longer is a mistake, not a wish.
MAX_TTL_S = 86_400.0
#: ``priority`` bounds.
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
#: What vLLM's API server accepts as a ``cache_salt`` (a tenant's name here).
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


def cache_salt_problem(value: object) -> str | None:
    """Why vLLM would refuse ``value`` as a ``cache_salt``; None: it would not."""
    if not isinstance(value, str) or not value:
        return "expected a non-empty string (vLLM's cache_salt)"
    if len(value) > MAX_CACHE_SALT_CHARS:
        return f"expected at most {MAX_CACHE_SALT_CHARS} characters (vLLM's cache_salt)"
    if any(c in value for c in CACHE_SALT_FORBIDDEN):
        return "must not contain '@', '/', '\\' or NUL (vLLM's cache_salt)"
    return None


@dataclass(frozen=True)
class Retention:
    """What a request asks of the tiers that hold its blocks (``kv_retention``)."""

    #: Keep its blocks at least this long after its last use (0: no wish).
    ttl_s: float = 0.0
    #: True: never evict its blocks while pinned; False: unpin them; None: as they are.
    pin: bool | None = None
    #: Which kept blocks yield first when a tier has only kept blocks left (lowest first).
    priority: int = 0


@dataclass(frozen=True)
class Controls:
    """A request's controls; None: not restricted."""

    load: frozenset[str] | None = None
    store: frozenset[str] | None = None
    max_offload_tokens: int | None = None
    retention: Retention | None = None
    #: Why the controls were refused (then nothing is loaded or saved).
    error: str | None = None

    def store_limit(self, node_id: str) -> int | None:
        """Tokens of the request ``node_id`` may save (from the start); None: all."""
        if self.store is not None and node_id not in self.store:
            return 0
        return self.max_offload_tokens


#: What a request without controls gets.
UNRESTRICTED = Controls()


def controls_of(params: Mapping[str, Any] | None) -> Controls:
    """The controls in ``params`` (a request's ``kv_transfer_params``)."""
    if not params or not any(key in params for key in KEYS):
        return UNRESTRICTED
    errors: list[str] = []
    load = _node_ids(params, LOAD_TIERS, errors)
    store = _node_ids(params, STORE_TIERS, errors)
    cap = params.get(MAX_OFFLOAD_TOKENS)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        errors.append(f"{MAX_OFFLOAD_TOKENS}: expected a whole number >= 0, got {cap!r}")
    retention = _retention(params.get(RETENTION), errors)
    if errors:
        return refused("; ".join(errors))
    return Controls(load, store, cap, retention)


def refused(error: str) -> Controls:
    return Controls(frozenset(), frozenset(), 0, None, error)


def unknown_names(controls: Controls, node_ids: Collection[str]) -> str | None:
    """What is wrong with ``controls`` for a pipeline of ``node_ids``; None: nothing."""
    if controls.error is not None:
        return controls.error
    errors = []
    for key, named in ((LOAD_TIERS, controls.load), (STORE_TIERS, controls.store)):
        unknown = sorted((named or frozenset()) - set(node_ids))
        if unknown:
            errors.append(
                f"{key}: unknown node(s) {', '.join(map(repr, unknown))}, which match no "
                f"node; the pipeline's nodes are {', '.join(map(repr, node_ids))}"
            )
    return "; ".join(errors) or None


def _retention(value: Any, errors: list[str]) -> Retention | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        expected = "expected an object {ttl_s, pin, priority}"
        errors.append(f"{RETENTION}: {expected}, got {value!r:.60}")
        return None
    unknown = sorted(set(value) - {"ttl_s", "pin", "priority"}, key=str)
    if unknown:
        errors.append(f"{RETENTION}: unknown key(s) {', '.join(map(repr, unknown))}; "
                      "expected ttl_s, pin, priority")
    ttl, pin, priority = value.get("ttl_s", 0.0), value.get("pin"), value.get("priority", 0)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 <= ttl <= MAX_TTL_S:
        errors.append(f"{RETENTION}.ttl_s: expected seconds from 0 to {MAX_TTL_S:.0f}, "
                      f"got {ttl!r:.40}")
    if pin is not None and not isinstance(pin, bool):
        errors.append(f"{RETENTION}.pin: expected true or false, got {pin!r:.40}")
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        errors.append(f"{RETENTION}.priority: expected a whole number from {MIN_PRIORITY} to "
                      f"{MAX_PRIORITY}, got {priority!r:.40}")
    if errors:
        return None
    return Retention(float(ttl), pin, priority)


def _node_ids(params: Mapping[str, Any], key: str, errors: list[str]) -> frozenset[str] | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        errors.append(f"{key}: expected a list of node ids, got {value!r:.80}")
        return None
    return frozenset(value)
