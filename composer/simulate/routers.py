"""The router models of ``kvc simulate --fleet``: where vllm-router 0.1.17 sends a request,
given what it sees of each engine when the request arrives.

What each policy weighs, as read in vllm-router's source (``src/policies/``) and
its ``--help`` (the defaults below are its own), for the requests ``kvc bench
--fleet`` sends (token-id prompts, the conversation named in ``x-session-id``):

* the **load** of an engine is the router's count of its requests in flight
  (raised when the router sends one, lowered when the response ends);
* ``round_robin``: engines in turn; ``random``: uniformly (seeded here);
* ``consistent_hash``: one engine per session (the router's ring of worker
  URLs is another partition of the same sessions: modelled as a hash);
* ``power_of_two``: two distinct engines drawn at random, the less loaded
  (the first drawn on a tie);
* ``sticky_least_loaded``: a session stays on its engine; a new session goes
  to the engine with the fewest sessions (ties broken by a hash of session and
  engine), sessions expiring after ``SESSION_TTL_S`` idle;
* ``cache_aware``: its guess of each engine's cache is a tree of request
  text, and a token-id prompt has none: it keys on the session header
  instead, a session going back to the engine it went to, a new one to the
  least loaded (the first of equals); when the load is imbalanced (``max -
  min > --balance-abs-threshold`` (64) and ``max > --balance-rel-threshold``
  (1.5) ``x min``) the least loaded whatever the session;
* ``kv_aware-vllm`` / ``kv_aware-tiers`` (``kv_aware.rs``,
  ``select_worker_with_qualified_inputs``): from the engines' KV events, each
  engine's credit for the prompt: its vLLM prefix cache's run from the first
  block in full, one node's run after it at ``--kv-penalty-external`` (0.6: KV
  Composer's events name their node) or not at all (``-vllm``), at most the
  prompt less one token, nothing for a request with a ``cache_salt``
  (``credited_tokens``); the new prefill is the prompt less its credit, rounded
  up. The cost of an engine (``MultiplicativeScorer``): (new prefill + the
  prefill the router reserved for its requests not yet at their first token)
  x (its requests in flight + 1); the least, the first of equals
  (``--router-temperature`` 0: no sampling); with ``affinity`` (vllm-router's
  ``--kv-aware-session-affinity-ttl-secs``), a session's request goes back to
  the engine its binding names while the binding lives (each request renews it
  for the TTL), else by cost and bound there. The router's worker order is
  random per router process; the simulator's engines are alike, so the first
  is engine 0 (the split, busiest first, is the same).

What was read: the router's ``--help`` (every default above) and its source:
``cache_aware.rs``, ``power_of_two.rs``, ``sticky_least_loaded.rs``, and
0.1.17's own sdist (``pip download vllm-router==0.1.17 --no-binary :all:``):
``src/policies/kv_aware.rs`` (its ``credited_tokens``, ``cost_components``,
``MultiplicativeScorer`` and ``pick_among``), ``src/routers/http/router.rs``
(the reservation released at a response's first data frame), whose log lines
match the installed binary's debug log.

The fleet's engines are :class:`composer.simulate.replay.Replay`; the router
sees them as they are when the request arrives (KV events reach it within
milliseconds).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from composer.simulate.replay import Replay
from composer.simulate.tiers import SimulateError
from composer.trace import TraceRequest, conversation

#: The router's credit for a block a node holds (vllm-router 0.1.17's default
#: ``--kv-penalty-external``), per kv_aware variant; vLLM's prefix cache is credited in full.
TIER_CREDIT = {"kv_aware-vllm": 0.0, "kv_aware-tiers": 0.6}
#: Every policy modelled (``kvc bench --fleet`` measures five of them:
#: :data:`composer.bench.fleet.POLICIES`).
ROUTERS = (
    "round_robin",
    "random",
    "consistent_hash",
    "power_of_two",
    "sticky_least_loaded",
    "cache_aware",
    *TIER_CREDIT,
)
#: sticky_least_loaded's idle session expiry (vllm-router's default, 2 hours).
SESSION_TTL_S = 7200.0
#: cache_aware's load balancing: on when the busiest engine has more than this many
#: requests over the idlest (``--balance-abs-threshold``) and more than this many
#: times its load (``--balance-rel-threshold``).
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


def session(req: TraceRequest) -> str:
    """The request's session, as ``kvc bench`` names it in ``x-session-id`` (its
    conversation), apart per tenant (two tenants' equal ids are two sessions)."""
    return f"{req.tenant}/{conversation(req)}" if req.tenant else conversation(req)


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass
class FleetView:
    """What the router sees of the fleet."""

    replays: list[Replay]
    #: Requests in flight per engine (the router's load).
    load: list[int]
    #: First key of a prompt -> engines that ever stored a prompt starting with it
    #: (only they can credit any of it: the rest are not asked).
    holders: dict[bytes, set[int]] = field(default_factory=dict)
    #: Prefill tokens reserved on each engine by its requests not yet at their first
    #: token: what the router estimated when it sent them (``estimate``).
    pending: list[int] = field(default_factory=list)
    #: What the last choice reserves on its engine: a ``kv_aware`` router's estimate
    #: of the prefill (the prompt less its credit there); None: the tokens the engine
    #: computes (a router that estimates nothing; no term reads it).
    estimate: int | None = None

    def __post_init__(self) -> None:
        self.pending = self.pending or [0] * len(self.load)


#: ``choose(view, req, keys, limit, now_s)`` -> engine index.
Choose = Callable[[FleetView, TraceRequest, Sequence[bytes], int, float], int]


def least_loaded(load: Sequence[int]) -> int:
    """The least loaded engine, the first of equals (Rust's ``min_by_key``)."""
    return min(range(len(load)), key=load.__getitem__)


def make_router(name: str, engines: int, seed: int = 0) -> Choose:
    """A fresh router of policy ``name`` (its state: turn, sessions, random draws); a
    ``kv_aware`` one may carry settings (:func:`parse_router`)."""
    rng = random.Random(seed)
    if name == "round_robin":
        turn = iter(range(1 << 62))
        return lambda view, req, keys, limit, now: next(turn) % engines
    if name == "random":
        return lambda view, req, keys, limit, now: rng.randrange(engines)
    if name == "consistent_hash":
        return lambda view, req, keys, limit, now: stable_hash(session(req)) % engines
    if name == "power_of_two":
        return _power_of_two(engines, rng)
    if name == "sticky_least_loaded":
        return _sticky(engines)
    if name == "cache_aware":
        return _cache_aware()
    spec = parse_router(name)
    return _kv_aware(spec.credit, spec.affinity_s)


def _power_of_two(engines: int, rng: random.Random) -> Choose:
    def choose(
        view: FleetView, req: TraceRequest, keys: Sequence[bytes], limit: int, now: float
    ) -> int:
        if engines == 1:
            return 0
        first = rng.randrange(engines)
        second = rng.randrange(engines - 1)
        second += second >= first  # two distinct engines
        return first if view.load[first] <= view.load[second] else second

    return choose


def _sticky(engines: int) -> Choose:
    sessions: dict[str, tuple[int, float]] = {}  # session -> (engine, last seen)
    active = [0] * engines

    def choose(
        view: FleetView, req: TraceRequest, keys: Sequence[bytes], limit: int, now: float
    ) -> int:
        name = session(req)
        known = sessions.get(name)
        if known is not None and now - known[1] < SESSION_TTL_S:
            sessions[name] = (known[0], now)
            return known[0]
        if known is not None:  # expired: its engine holds one session fewer
            active[known[0]] -= 1
        fewest = min(active)
        engine = max(
            (e for e in range(engines) if active[e] == fewest),
            key=lambda e: stable_hash(f"{name}:{e}"),
        )
        active[engine] += 1
        sessions[name] = (engine, now)
        return engine

    return choose


def _cache_aware() -> Choose:
    sessions: dict[str, int] = {}

    def choose(
        view: FleetView, req: TraceRequest, keys: Sequence[bytes], limit: int, now: float
    ) -> int:
        load = view.load
        low, high = min(load), max(load)
        name = session(req)
        if high - low > BALANCE_ABS_THRESHOLD and high > low * BALANCE_REL_THRESHOLD:
            engine = least_loaded(load)  # imbalanced: the shortest queue, remembered
        else:
            engine = sessions.get(name, -1)
            if engine < 0:
                engine = least_loaded(load)
        sessions[name] = engine
        return engine

    return choose


def _kv_aware(credit: float, affinity_s: int | None) -> Choose:
    #: Session -> (its engine, when its binding expires): ``affinity``'s table.
    bound: dict[str, tuple[int, float]] = {}

    def choose(
        view: FleetView, req: TraceRequest, keys: Sequence[bytes], limit: int, now: float
    ) -> int:
        engines = range(len(view.load))
        replays = view.replays
        prompt = replays[0].keymaker.prompt_tokens(req)
        credits = [0.0] * len(view.load)
        # A request with a cache_salt (a tenant) is credited nothing (credited_tokens).
        holders = view.holders.get(keys[0], ()) if keys and limit and not req.tenant else ()
        for engine in holders:
            gpu, tier = replays[engine].holds(keys, limit)
            # vLLM's run from the first block in full, one node's run after it at the
            # penalty; the last token is always computed.
            credits[engine] = min((gpu + credit * tier) * replays[engine].unit, prompt - 1)
        new = [math.ceil(max(prompt - c, 0.0)) for c in credits]
        name = session(req)  # (the x-session-id, scoped by the cache_salt)
        binding = bound.get(name) if affinity_s is not None else None
        if binding is not None and now <= binding[1]:
            engine = binding[0]  # a sticky hit: its engine, whatever it costs
        else:
            # MultiplicativeScorer: (new prefill + prefill reserved by the engine's
            # requests not yet at their first token) x (requests in flight + this one);
            # the minimum, the first of equals.
            engine = min(engines, key=lambda e: (new[e] + view.pending[e]) * (view.load[e] + 1))
        if affinity_s is not None:
            # The router's binding idles from its last request's end; here from its
            # arrival (a request's time apart, against a TTL of seconds).
            bound[name] = (engine, now + affinity_s)
        view.estimate = new[engine]
        return engine

    return choose


@dataclass(frozen=True)
class RouterSpec:
    """A policy as ``--router`` (and ``kvc bench --policy``) names it: one of
    :data:`ROUTERS`, a ``kv_aware`` one with vllm-router's settings after a colon
    (``kv_aware-tiers:external=0.8,affinity=300``; :data:`KV_AWARE_SETTINGS`)."""

    policy: str
    #: ``external``: the credit of a block a node's event names (None: the variant's).
    external: float | None = None
    #: ``affinity``: a session's binding to its engine, idle seconds (None: none).
    affinity_s: int | None = None

    @property
    def credit(self) -> float:
        return TIER_CREDIT[self.policy] if self.external is None else self.external

    def router_args(self) -> tuple[str, ...]:
        """vllm-router's flags for the settings (the policy's own come first)."""
        args: tuple[str, ...] = ()
        if self.external is not None:
            args += (KV_AWARE_SETTINGS["external"], f"{self.external:g}")
        if self.affinity_s is not None:
            args += (KV_AWARE_SETTINGS["affinity"], str(self.affinity_s))
        return args


#: The settings a ``kv_aware`` policy takes: name -> vllm-router's flag.
KV_AWARE_SETTINGS = {
    "external": "--kv-penalty-external",
    "affinity": "--kv-aware-session-affinity-ttl-secs",
}
#: vllm-router's bound on ``--kv-aware-session-affinity-ttl-secs``.
MAX_AFFINITY_S = 31_536_000


def parse_router(text: str, option: str = "--router") -> RouterSpec:
    """``text`` as a :class:`RouterSpec`; a :class:`SimulateError` naming ``option``,
    the text and what was expected for anything else."""
    base, colon, rest = text.partition(":")
    where = f"{option} {text!r}"
    if base not in ROUTERS:
        raise SimulateError(f"{where}: one of {', '.join(ROUTERS)}")
    if not colon:
        return RouterSpec(base)
    if base not in TIER_CREDIT:
        raise SimulateError(f"{where}: settings after ':' are a kv_aware policy's")
    values: dict[str, str] = {}
    for item in rest.split(","):
        name, eq, value = (part.strip() for part in item.partition("="))
        if name not in KV_AWARE_SETTINGS or not eq:
            raise SimulateError(
                f"{where}: expected NAME=VALUE,... with NAME one of "
                f"{', '.join(KV_AWARE_SETTINGS)}, got {item!r}"
            )
        if name in values:
            raise SimulateError(f"{where}: {name} given twice")
        values[name] = value
    external = affinity = None
    if "external" in values:
        if base == "kv_aware-vllm":
            raise SimulateError(
                f"{where}: kv_aware-vllm credits no tier; external is kv_aware-tiers'"
            )
        external = _number(where, "external", values["external"], 0.0, 1.0)
    if "affinity" in values:
        seconds = _number(where, "affinity", values["affinity"], 1, MAX_AFFINITY_S)
        if seconds != int(seconds):
            raise SimulateError(f"{where}: affinity: whole seconds, got {values['affinity']!r}")
        affinity = int(seconds)
    return RouterSpec(base, external, affinity)


def _number(where: str, name: str, value: str, low: float, high: float) -> float:
    try:
        number = float(value)
    except ValueError:
        raise SimulateError(f"{where}: {name}: not a number: {value!r}") from None
    if not low <= number <= high:  # (NaN fails too)
        raise SimulateError(f"{where}: {name}: expected {low:,.15g} to {high:,.15g}, got {value!r}")
    return number


def check_router(name: str) -> None:
    parse_router(name)
