"""Cache policies: which blocks a tier admits, which it evicts and which it must keep,
as plugins.

A tier (``offload-cpu``'s index, and its simulator, which runs the same code)
does not decide these itself: it asks the policies its node config names
(``eviction: lru``, ``admission: threshold``, ``retention: request``). A policy
is a class with the methods of its kind's spec below, registered by a plugin
package with one hookimpl, as plugin types are::

    @hookimpl
    def register_cache_policies(register):
        register(CachePolicy("fifo", "eviction", Fifo, "first saved, first evicted"))

and found by :func:`composer.discovery.discover` (``registry.policies``). A node
config field names a policy by kind (``Annotated[str, PolicyName("eviction")]``):
validation refuses an unknown name before launch, located, with did-you-mean.

The built-ins (:mod:`composer.builtin_policies`): ``lru`` and ``arc`` (eviction),
``threshold`` (admission: ``store_threshold``) and ``request`` (retention: what
each request's ``kv_retention`` asks), on the same specs.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from composer.controls import Retention

Kind = Literal["eviction", "admission", "retention"]
KINDS: tuple[Kind, ...] = ("eviction", "admission", "retention")


class Block(Protocol):
    """What a policy sees of a block the tier holds (the tier's own entry)."""

    #: The block's key (vLLM's block hash, with the node's salt).
    key: bytes

    @property
    def size(self) -> int:
        """The tier's slots it takes (the unit of the policy's ``slots``): 1, or, for
        a hybrid model, one per KV cache group of its layout (the groups' blocks at
        one position are one entry)."""


class EvictionPolicy:
    """The spec of an eviction policy: the tier tells it what happens to its blocks and
    asks it which goes first. Constructed once per tier with the tier's size in
    blocks and the node's config. A block the tier cannot give up (a load is
    reading it) is skipped by the tier, never by the policy."""

    def __init__(self, slots: int, config: Any = None) -> None:
        self.slots = slots

    def added(self, block: Block) -> None:
        """A block was saved and can be served."""
        raise NotImplementedError

    def touched(self, block: Block) -> None:
        """A block was served (a hit)."""

    def victims(self) -> Iterator[Block]:
        """The blocks the tier may evict, the first to go first."""
        raise NotImplementedError

    def removed(self, block: Block, evicted: bool) -> None:
        """A block left the tier: evicted to make room (``evicted``), or dropped
        (a failed save, a reset, corrupt data)."""
        raise NotImplementedError


class AdmissionPolicy:
    """The spec of an admission policy: whether a request's blocks take room in the tier.
    Constructed once per tier with the tier's size in blocks and the node's config."""

    def __init__(self, slots: int, config: Any = None) -> None:
        self.slots = slots

    def admit(self, keys: Sequence[bytes]) -> int:
        """How many of a request's blocks (``keys``, in order) to save, from the first:
        ``len(keys)`` saves every one, 0 none. Called once per request the tier
        would save."""
        raise NotImplementedError


class RetentionPolicy:
    """The spec of a retention policy: what requests asked of the blocks they used
    (``kv_retention`` in their ``kv_transfer_params``), and which blocks must stay.
    Constructed once per tier with the tier's size in blocks and the node's config.
    ``now`` is the tier's clock (seconds; the simulator's is the trace's)."""

    #: True: it keeps only blocks a request asked it to (``requested``), so the tier
    #: asks it nothing (``kept``, ``yields``, ``removed``) until a request has.
    asked_only: bool = False

    def __init__(self, slots: int, config: Any = None) -> None:
        self.slots = slots

    def requested(self, block: Block, retention: Retention, now: float) -> bool:
        """A request that saved or was served ``block`` asked for ``retention``; called
        when the request finishes (its last use). False: not granted (a pin over the
        tier's cap)."""
        raise NotImplementedError

    def kept(self, block: Block, now: float) -> bool:
        """Whether ``block`` must stay now: the tier evicts the next block of the
        eviction policy's ``victims()`` instead."""
        raise NotImplementedError

    def yields(self, kept: Sequence[Block], now: float) -> Block | None:
        """Every block the tier could evict is kept: the one that goes anyway, or None
        (nothing new is saved until a block may go). Default: None."""
        return None

    def removed(self, block: Block) -> None:
        """A block left the tier. Default: nothing."""


SPECS: dict[Kind, type] = {
    "eviction": EvictionPolicy,
    "admission": AdmissionPolicy,
    "retention": RetentionPolicy,
}
#: The methods a policy of each kind must define (the others have a default).
REQUIRED: dict[Kind, tuple[str, ...]] = {
    "eviction": ("added", "victims", "removed"),
    "admission": ("admit",),
    "retention": ("requested", "kept"),
}


@dataclass(frozen=True)
class CachePolicy:
    """A policy a plugin package provides: its name in node configs, its kind, its class."""

    name: str
    kind: Kind
    cls: type
    description: str = ""
    #: The distribution that registered it (set by discovery).
    package: str = ""

    def problems(self) -> list[str]:
        """What makes this registration unusable (empty: none)."""
        if not isinstance(self.name, str) or not self.name:
            return ["a cache policy needs a non-empty string name"]
        if self.kind not in KINDS:
            return [f'cache policy "{self.name}": kind must be one of {", ".join(KINDS)}']
        spec = SPECS[self.kind]
        if not (isinstance(self.cls, type) and issubclass(self.cls, spec)):
            return [f'cache policy "{self.name}": its class must subclass {spec.__name__}']
        missing = [m for m in REQUIRED[self.kind] if getattr(self.cls, m) is getattr(spec, m)]
        if missing:
            return [f'cache policy "{self.name}": {self.cls.__name__} lacks ' + ", ".join(missing)]
        return []


@dataclass(frozen=True)
class PolicyName:
    """Marks a node config field as the name of a cache policy of ``kind``
    (``Annotated[str, PolicyName("eviction")]``): validated against the installed
    policies before launch."""

    kind: Kind
