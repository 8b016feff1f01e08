"""Plugin types: what a package registers through the discovery hook."""

from __future__ import annotations

import pkgutil
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict

#: The vLLM processes a node can run in.
VllmProcess = Literal["scheduler", "worker"]
#: What a node does for the pipeline.
NodeRole = Literal["load", "save", "both", "transport", "service"]
KVLayout = Literal["NHD", "HND"]


class EmptyConfig(BaseModel):
    """Config of a plugin that takes no options."""

    model_config = ConfigDict(extra="forbid")


class Capabilities(BaseModel):
    """What a plugin type can do; the graph checks combine these across nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hma: bool = False
    """Supports vLLM's hybrid memory allocator (``request_finished_all_groups``)."""
    kv_cache_groups: Literal["all", "attention", "one"] = "all"
    """Which KV cache groups it handles; "one" needs ``kv_cache_group`` in its config."""
    needs_model: bool = False
    """Wants the loaded model through ``initialize_worker_connector``."""
    provides_model: bool = False
    """Offers the model to nodes that ``need`` it (the model tracker)."""
    provides_handshake: bool = False
    provides_memory_pool: bool = False
    kv_layout: KVLayout | None = None
    async_save: bool = False
    async_load: bool = False
    requires_piecewise_cudagraph: bool = False
    transfer_params_keys: frozenset[str] = frozenset()
    """``kv_transfer_params`` keys this node writes; two nodes may not share one."""
    sleep_mode: bool | None = None
    """Follows vLLM's sleep mode (its KV cache memory released, then remapped). None:
    judged from the node's worker class, yes unless it implements
    ``register_kv_caches`` without ``unregister_kv_caches`` and ``restore_kv_caches``."""


#: A node class, or ``"module:Class"`` so that validating a pipeline never imports
#: the (possibly torch-heavy) runtime module; or a function of the node's config
#: returning the class (a plugin whose class depends on a config option), or its
#: ``"module:function"``.
ClassRef = str | type | Callable[[Any], type]
#: What a node serves of a model's KV cache groups (see :mod:`composer.model.support`):
#: ``(node config, ModelKV) -> one line``, raising ``composer.ModelUnsupported``
#: to refuse; or its ``"module:function"``, imported only when a model is checked.
ModelSupport = str | Callable[[Any, Any], str]
#: Extra checks of a node against the whole pipeline file: yields (path, message).
Check = Callable[[str, BaseModel, dict[str, Any]], Iterable[tuple[tuple[str | int, ...], str]]]
_ALL_PROCESSES: frozenset[VllmProcess] = frozenset({"scheduler", "worker"})
_DEFAULT_ROLES: frozenset[NodeRole] = frozenset({"load", "save", "both"})


class PluginTypeError(TypeError):
    """A ``PluginType`` that names its classes, processes or roles inconsistently."""


@dataclass(frozen=True, init=False)
class PluginType:
    """One kind of pipeline node, as registered by ``register_plugin_types``.

    The node's classes: ``node`` is one class for every vLLM process it runs in;
    or ``scheduler`` / ``worker`` name a class per process (either alone makes a
    node of that process only). Each is a class or ``"module:Class"``, or a
    function of the node's config that returns the class.

    Inferred when not given: ``processes`` from the classes named (``node``
    alone: both processes); ``default_role`` is the only role in ``roles``, else
    ``"both"`` when ``roles`` allows it (else it must be given).
    ``capabilities`` is a :class:`Capabilities` or a function of the node's
    validated config returning one.
    """

    name: str
    node: ClassRef | None
    scheduler: ClassRef | None
    worker: ClassRef | None
    config: type[BaseModel]
    description: str
    processes: frozenset[VllmProcess]
    #: Roles a node of this type may take in a pipeline, and the one it takes by default.
    roles: frozenset[NodeRole]
    default_role: NodeRole
    capabilities: Capabilities | Callable[[Any], Capabilities]
    check: Check | None
    #: ``"module:Class"`` of its model for ``kvc simulate`` (see
    #: :class:`composer.simulate.TierModel`); imported only by that command. None: not
    #: modelled, the simulator shows the node as such.
    simulator: str | None
    #: What a node serves of a model's KV cache groups (``kvc validate --model``).
    #: None: judged from ``capabilities.hma``
    #: (see :func:`composer.model.support.default_support`).
    model_support: ModelSupport | None
    #: Filled by discovery: the distribution that registered it.
    package: str
    version: str

    def __init__(  # noqa: PLR0913 - one keyword per declared property
        self,
        name: str,
        node: ClassRef | None = None,
        *,
        scheduler: ClassRef | None = None,
        worker: ClassRef | None = None,
        config: type[BaseModel] = EmptyConfig,
        description: str = "",
        processes: Iterable[VllmProcess] | None = None,
        roles: Iterable[NodeRole] = _DEFAULT_ROLES,
        default_role: NodeRole | None = None,
        capabilities: Capabilities | Callable[[Any], Capabilities] = Capabilities(),  # noqa: B008 - frozen
        check: Check | None = None,
        simulator: str | None = None,
        model_support: ModelSupport | None = None,
        package: str = "",
        version: str = "",
    ) -> None:
        roles = frozenset(roles)
        if processes is None:
            processes = _inferred_processes(node, scheduler, worker)
        values: dict[str, Any] = {
            "name": name, "node": node, "scheduler": scheduler, "worker": worker,
            "config": config, "description": description,
            "processes": frozenset(processes), "roles": roles,
            "default_role": default_role or _inferred_default_role(roles),
            "capabilities": capabilities, "check": check,
            "simulator": simulator, "model_support": model_support,
            "package": package, "version": version,
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def class_refs(self) -> dict[VllmProcess, ClassRef]:
        """The class (or ``"module:Class"``) of each vLLM process the node runs in."""
        given = {"scheduler": self.scheduler, "worker": self.worker}
        return {
            role: ref
            for role in sorted(self.processes)
            if (ref := given[role] or self.node) is not None
        }

    def node_class(
        self, process: VllmProcess | None = None, config: BaseModel | None = None
    ) -> type:
        """The class the node is made of in ``process``'s process (imports it).

        Without ``process``: the one class of the type (``node``, or the only
        per-process class given). ``config`` (the node's validated config) is
        needed where the type chooses its class from the config.
        """
        refs = self.class_refs()
        if process is None:
            ones = [self.node] if self.node is not None else [*refs.values()]
            if len(ones) != 1:
                raise PluginTypeError(
                    f'plugin type "{self.name}" has a class per vLLM process: '
                    "name the process (node_class('scheduler') or node_class('worker'))"
                )
            ref = ones[0]
        elif process in refs:
            ref = refs[process]
        else:
            raise PluginTypeError(
                f'plugin type "{self.name}" does not run in the {process} process '
                f"(it runs in: {', '.join(sorted(self.processes))})"
            )
        return choose_class(resolve_ref(ref), config, f'plugin type "{self.name}"')

    def resolve_capabilities(self, config: BaseModel) -> Capabilities:
        if isinstance(self.capabilities, Capabilities):
            return self.capabilities
        return self.capabilities(config)

    def problems(self) -> list[str]:
        """What is inconsistent in this declaration (discovery refuses the type)."""
        out: list[str] = []
        named = [k for k in ("scheduler", "worker") if getattr(self, k) is not None]
        if self.node is None and not named:
            out.append("give node= (one class) or scheduler= / worker= (a class per process)")
        if self.node is not None and named:
            out.append(f"give node= or {' / '.join(n + '=' for n in named)}, not both")
        for key in ("node", *named):
            ref = getattr(self, key)
            if ref is not None and not _is_class_ref(ref):
                out.append(
                    f'{key} must be a class, "module:Class" or a function, not {ref!r}'
                )
        if not self.processes or not self.processes <= _ALL_PROCESSES:
            out.append(
                f"processes must name scheduler and/or worker, not {sorted(self.processes)}"
            )
        for key in named:
            if key not in self.processes:
                out.append(f"{key}= is given but processes does not include {key}")
        if self.node is None and named and not self.processes <= set(named):
            missing = sorted(self.processes - set(named))
            out.append(f"processes includes {', '.join(missing)} but no class is given for it")
        unknown = sorted(map(str, self.roles - set(get_args(NodeRole))))
        if unknown or not self.roles:
            out.append(
                f"roles must name some of {', '.join(get_args(NodeRole))}, "
                f"not {unknown or 'nothing'}"
            )
        elif self.default_role not in self.roles:
            out.append(
                f'default_role "{self.default_role}" is not one of roles '
                f"({', '.join(sorted(self.roles))}); set default_role"
            )
        if not (isinstance(self.capabilities, Capabilities) or callable(self.capabilities)):
            out.append("capabilities must be a Capabilities or a function of the config")
        support = self.model_support
        if support is not None and not (callable(support) or _is_class_ref(support)):
            out.append(f'model_support must be a function or "module:function", not {support!r}')
        return out

    def config_fields(self) -> dict[str, Any]:
        return model_fields(self.config)


def model_fields(model: type[BaseModel]) -> dict[str, Any]:
    """Each field of ``model`` as ``kvc plugins`` lists it: type, default, whether
    required, description (a plugin type's config, a cache policy's options)."""
    return {
        name: {
            "type": _type_name(f.annotation),
            "default": None if f.is_required() else f.get_default(call_default_factory=True),
            "required": f.is_required(),
            "description": f.description or "",
        }
        for name, f in model.model_fields.items()
    }


def resolve_ref(ref: ClassRef | ModelSupport) -> object:
    """What ``ref`` names: a ``"module:attr"`` string is imported (by
    :func:`pkgutil.resolve_name`), anything else is itself."""
    if not isinstance(ref, str):
        return ref
    return pkgutil.resolve_name(ref)


def choose_class(obj: object, config: BaseModel | None, owner: str) -> type:
    """``obj`` if it is a class; else the class it returns for ``config``."""
    if isinstance(obj, type):
        return obj
    if not callable(obj):
        raise PluginTypeError(f"{owner}: {obj!r} is neither a class nor a function")
    if config is None:
        raise PluginTypeError(f"{owner} chooses its class from the node's config: pass it")
    cls = obj(config)
    if not isinstance(cls, type):
        raise PluginTypeError(f"{owner}: {obj!r} returned {cls!r}, not a class")
    return cls


def _is_class_ref(ref: object) -> bool:
    if callable(ref):
        return True
    if not isinstance(ref, str):
        return False
    module, sep, attr = ref.partition(":")
    return bool(module and sep and attr)


def _inferred_processes(
    node: ClassRef | None, scheduler: ClassRef | None, worker: ClassRef | None
) -> frozenset[VllmProcess]:
    if node is not None or (scheduler is None and worker is None):
        return _ALL_PROCESSES
    named: set[VllmProcess] = set()
    if scheduler is not None:
        named.add("scheduler")
    if worker is not None:
        named.add("worker")
    return frozenset(named)


def _inferred_default_role(roles: frozenset[NodeRole]) -> NodeRole:
    if len(roles) == 1:
        (role,) = roles
        return role
    # "both" when allowed; otherwise it must be chosen (PluginType.problems says so).
    return "both"


def _type_name(annotation: Any) -> str:
    """A short readable type: ``'kv_producer' | 'kv_both' | None`` rather than ``Optional``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")
