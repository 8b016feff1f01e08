"""Cache policies: which blocks a tier admits, which it evicts and which it must keep,
as plugins.

A tier (``offload-cpu``'s index, and its simulator, which runs the same code)
does not decide these itself: it asks the policies its node config names
(``eviction: lru``, ``admission: threshold``, ``retention: request``). A policy
is a class with the methods of its kind's spec below, registered by a plugin
package with one hookimpl, as plugin types are::

    @hookimpl
    def register_cache_policies(register):
        register(CachePolicy("lfu", "eviction", Lfu, "least served first", options=LfuOptions))

and found by :func:`composer.discovery.discover` (``registry.policies``; a registration
that cannot be used is kept aside in ``registry.broken_policies``, refused only where a
pipeline names it). A node config field names a policy by kind (``Annotated[str,
PolicyName("eviction")]``) and gives its options beside it (``eviction_options:
PolicyOptions``): validation refuses an unknown name, and options the named policy's
model does not accept, before launch, located, with did-you-mean
(:mod:`composer.validation.policies`). The policy reads its options with
:func:`policy_options`; the tier builds it as ``cls(slots, config)`` with the node's
config, whatever its options.

The built-ins (:mod:`composer.builtin_policies`): ``lru`` and ``arc`` (eviction),
``threshold`` (admission: ``store_threshold``) and ``request`` (retention: what
each request's ``kv_retention`` asks), on the same specs.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, BeforeValidator

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

    def passed_over(self, block: Block) -> None:
        """A block ``victims()`` offered stays: the retention policy keeps it (a pin, a
        TTL). Moving it out of the front (as ``lru`` and ``arc`` do, within its list) keeps
        the next eviction from walking it again: without it, every eviction walks every
        kept block ahead of the first one that may go. Default: nothing."""

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
    """A policy a plugin package provides: its name in node configs, its kind, its class,
    and the model of its options (``options``: a pydantic model class, validated from the
    node config's ``<kind>_options`` before launch and read by the policy with
    :func:`policy_options`; None: it takes none)."""

    name: str
    kind: Kind
    cls: type
    description: str = ""
    options: type[BaseModel] | None = None
    #: The distribution that registered it, and its version (set by discovery).
    package: str = ""
    version: str = ""

    def problems(self) -> list[str]:
        """What makes this registration unusable (empty: none)."""
        if not isinstance(self.name, str) or not self.name:
            return ["a cache policy needs a non-empty string name"]
        if self.kind not in KINDS:
            return [f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}"]
        spec = SPECS[self.kind]
        if isinstance(self.cls, spec):
            name = type(self.cls).__name__
            return [f"registers an instance of {name}; register the class, {name}"]
        if not (isinstance(self.cls, type) and issubclass(self.cls, spec)):
            return [f"its class must subclass {spec.__name__}, got {_shown(self.cls)}"]
        out = []
        if self.options is not None and not (
            isinstance(self.options, type) and issubclass(self.options, BaseModel)
        ):
            out.append(f"options must be a pydantic model class, got {_shown(self.options)}")
        missing = [m for m in REQUIRED[self.kind] if getattr(self.cls, m) is getattr(spec, m)]
        if missing:
            out.append(f"{self.cls.__name__} lacks " + ", ".join(missing))
        return out + method_problems(self.cls, self.kind)


def _shown(obj: object) -> str:
    """A registered object, named for a message: a class by its name, anything else by
    its type (an instance's repr can be long, or raise)."""
    if isinstance(obj, type):
        return f"class {obj.__name__}"
    return f"an instance of {type(obj).__name__}"


def spec_calls(kind: Kind) -> dict[str, tuple[str, ...]]:
    """Each method the tier calls on a ``kind`` policy (``__init__`` included: it builds
    the policy as ``cls(slots, config)``), with the arguments it passes, positionally."""
    spec = SPECS[kind]
    methods = {
        name: fn
        for name, fn in vars(spec).items()
        if inspect.isfunction(fn) and (name == "__init__" or not name.startswith("_"))
    }
    return {name: tuple(inspect.signature(fn).parameters)[1:] for name, fn in methods.items()}


def method_problems(cls: type, kind: Kind) -> list[str]:
    """Each method of ``cls`` (a subclass of ``kind``'s spec) that cannot take the call the
    tier makes, as the spec declares it: ``removed(self, block)`` on an eviction policy
    would raise at the first eviction (the tier calls ``removed(block, evicted)``)."""
    spec = SPECS[kind]
    out = []
    for name, args in spec_calls(kind).items():
        own = inspect.getattr_static(cls, name)
        if own is inspect.getattr_static(spec, name):
            continue  # the spec's own
        problem = _call_problem(own, args)
        if problem:
            call = f"{name}({', '.join(args)})"
            if name == "__init__":  # (the tier builds a policy as cls(slots, config))
                call = f"{cls.__name__}({', '.join(args)})"
            out.append(f"{cls.__name__}.{name}{problem.replace('CALL', call)}")
    return out


def _call_problem(attr: object, args: tuple[str, ...]) -> str:
    """Why ``attr`` (a class attribute) cannot be called on an instance with ``args``, with
    ``CALL`` where the call goes ("": it can, or Python cannot read its signature)."""
    if isinstance(attr, staticmethod):
        fn, bound = attr.__func__, False
    elif isinstance(attr, classmethod):
        fn, bound = attr.__func__, True
    elif inspect.isfunction(attr):
        fn, bound = attr, True
    else:
        return f" is not a method ({type(attr).__name__}): the tier calls CALL"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    # Shown by its parameters only: annotations may be strings (``from __future__``).
    params = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    signature = signature.replace(parameters=params, return_annotation=signature.empty)
    if bound:
        first = params[0].kind if params else None
        if first in (None, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD):
            return f"{signature} takes no self: the tier calls CALL on an instance"
        if first is not inspect.Parameter.VAR_POSITIONAL:
            params = params[1:]
    try:
        signature.replace(parameters=params).bind(*args)
    except TypeError as exc:
        return f"{signature} cannot take the tier's call CALL: {exc}"
    return ""


def misnamed_methods(cls: type, kind: Kind) -> list[str]:
    """Methods of ``cls`` whose name is close to a spec method it leaves to the spec's
    default (``touch`` beside the default ``touched``): the tier never calls them, so the
    policy silently runs without them. For ``kvc validate --deep``: a guess, not a rule."""
    spec = SPECS[kind]
    calls = spec_calls(kind)
    defaulted = [
        n for n in calls if inspect.getattr_static(cls, n) is inspect.getattr_static(spec, n)
    ]
    own = {
        name
        for klass in cls.__mro__
        if klass not in spec.__mro__
        for name, value in vars(klass).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or isinstance(value, staticmethod | classmethod))
    }
    out = []
    for name in sorted(own - set(calls)):
        close = difflib.get_close_matches(name, defaulted, n=1, cutoff=0.8)
        if close:
            out.append(
                f'{cls.__name__} defines "{name}" (did you mean "{close[0]}"?): the tier calls '
                f'"{close[0]}", never "{name}", so {cls.__name__} runs with the spec\'s default'
            )
    return out


@dataclass(frozen=True)
class PolicyName:
    """Marks a node config field as the name of a cache policy of ``kind``
    (``Annotated[str, PolicyName("eviction")]``): validated against the installed
    policies before launch. The policy's options are the field ``<field>_options``
    beside it (``eviction_options``, typed :data:`PolicyOptions`), validated against
    the named policy's options model."""

    kind: Kind

    @staticmethod
    def options_field(field: str) -> str:
        """The config field holding the options of the policy named in ``field``."""
        return f"{field}_options"


def _none_as_empty(value: Any) -> Any:
    # `eviction_options:` with every option commented out reads as null: no options.
    return {} if value is None else value


#: A node config field holding the options of the policy its ``PolicyName`` field names
#: (``eviction_options: PolicyOptions``): a mapping, validated before launch by that
#: policy's options model (its keys, types and values, located in the file).
PolicyOptions = Annotated[dict[str, Any], BeforeValidator(_none_as_empty)]

_Options = TypeVar("_Options", bound=BaseModel)


def policy_options(config: Any, kind: Kind, model: type[_Options]) -> _Options:
    """The options the node's config gives its ``kind`` policy, as ``model`` (the model the
    policy registered as its ``options``), for the policy's ``__init__``::

        self.max_count = policy_options(config, "eviction", LfuOptions).max_count

    Validation has checked them before launch; here they are read from the config's
    ``<field>_options`` (``eviction_options``) and given their defaults. No config,
    or no options given: ``model()``, every default."""
    raw = getattr(config, _options_field_of(config, kind), None)
    if isinstance(raw, model):
        return raw
    return model.model_validate(raw or {})


def _options_field_of(config: Any, kind: Kind) -> str:
    """The options field of ``config``'s ``kind`` policy: beside the field marked
    ``PolicyName(kind)``; ``<kind>_options`` for a config that marks none."""
    for field, info in getattr(type(config), "model_fields", {}).items():
        if any(isinstance(m, PolicyName) and m.kind == kind for m in info.metadata):
            return PolicyName.options_field(field)
    return f"{kind}_options"


def policy_fields(config_model: type[BaseModel]) -> dict[str, Kind]:
    """The fields of a node config model that name a cache policy, with its kind."""
    out: dict[str, Kind] = {}
    for field, info in config_model.model_fields.items():
        marks = [m for m in info.metadata if isinstance(m, PolicyName)]
        if marks:
            out[field] = marks[0].kind
    return out
