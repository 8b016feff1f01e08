"""The pipeline file's shape (pydantic), and the resolved pipeline the chain runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from composer.plugin_types import Capabilities, NodeRole, PluginType

NODE_ID_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]*$"
NodeId = Annotated[str, StringConstraints(pattern=NODE_ID_PATTERN, max_length=64)]
# pydantic puts a dict key's pattern in patternProperties, which lets any other key
# through; JSON Schema checks keys with propertyNames.
_NODES_SCHEMA: JsonDict = {"propertyNames": {"pattern": NODE_ID_PATTERN, "maxLength": 64}}
ErrorPolicy = Literal["fail", "disable", "recompute"]
LoadPolicy = Literal["first_hit", "longest_hit", "ranges"]
KVRole = Literal["kv_both", "kv_producer", "kv_consumer"]
KV_ROLES: tuple[KVRole, ...] = get_args(KVRole)
#: A side of disaggregated prefill/decode: the prefill engine (vLLM's
#: kv_producer) or the decode engine (kv_consumer). A kv_both engine is both.
Side = Literal["producer", "consumer"]
SIDES: tuple[Side, ...] = ("producer", "consumer")
#: The names a side's role is given by where it runs (``kvc serve --kv-role``,
#: ``load_pipeline(kv_role=...)``): the short ones, or vLLM's own.
KV_ROLE_NAMES: dict[str, KVRole] = {
    "producer": "kv_producer",
    "consumer": "kv_consumer",
    "both": "kv_both",
    "kv_producer": "kv_producer",
    "kv_consumer": "kv_consumer",
    "kv_both": "kv_both",
}


def kv_role_named(name: str) -> KVRole:
    """vLLM's ``kv_role`` for a side's role given as ``producer``, ``consumer``,
    ``both`` or vLLM's own name; ValueError for anything else (a caller's mistake,
    not the file's)."""
    try:
        return KV_ROLE_NAMES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"kv_role {name!r} is not a side's role; expected one of "
            + ", ".join(KV_ROLE_NAMES)
        ) from None


def sides_of(kv_role: KVRole) -> tuple[Side, ...]:
    """The P/D sides an engine of this ``kv_role`` plays."""
    if kv_role == "kv_producer":
        return ("producer",)
    if kv_role == "kv_consumer":
        return ("consumer",)
    return SIDES

SCHEMA_ID = "https://kv-composer.dev/schemas/pipeline.schema.json"


# --------------------------------------------------------------------------- #
# Strict value types for configs. pydantic's lax mode reads YAML's true as 1 and
# accepts .inf / .nan as floats; a pipeline means neither.
# --------------------------------------------------------------------------- #


def _no_bool(kind: str, message: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise PydanticCustomError(kind, message)
        return value

    return BeforeValidator(check)


def _exactly_int(value: Any) -> Any:
    # Literal[1] would take true and 1.0, which equal 1 in Python.
    if type(value) is not int:
        raise PydanticCustomError("literal_error", "Input should be 1")
    return value


#: Largest size a pipeline may give: 1 EiB. No machine holds that much memory or
#: disk (x86-64 and arm64 address at most 2**57 bytes), so a larger size is a typo
#: or a unit gone wrong, refused before launch rather than tried at node start.
MAX_BYTE_SIZE = 2**60


def _positive_size(value: ByteSize) -> ByteSize:
    if value <= 0:
        raise PydanticCustomError("greater_than", "Input should be greater than {gt}", {"gt": 0})
    if value > MAX_BYTE_SIZE:
        raise PydanticCustomError("byte_size_too_large", "Input should be at most 1EiB")
    return value


#: An integer; true/false refused.
Int = Annotated[int, _no_bool("int_type", "Input should be a valid integer")]
#: A finite number; true/false, .inf and .nan refused.
Number = Annotated[
    float, _no_bool("float_type", "Input should be a valid number"), AllowInfNan(False)
]
#: A TCP port, 1 to 65535.
Port = Annotated[Int, Field(ge=1, le=65535)]
#: A size in bytes greater than 0 and at most 1 EiB ("8GiB", 1048576); true/false refused.
PositiveByteSize = Annotated[
    ByteSize,
    _no_bool("byte_size", "Input should be a size"),
    AfterValidator(_positive_size),
    Field(json_schema_extra={"exclusiveMinimum": 0}),
]


def _none_as_empty(value: Any) -> Any:
    # `config:` whose options are all commented out reads as null: no options.
    return {} if value is None else value


class Node(BaseModel):
    """One plugin instance in the pipeline."""

    model_config = ConfigDict(extra="forbid")

    plugin: str = Field(description="Plugin type name (see `kvc plugins`).")
    config: Annotated[dict[str, Any], BeforeValidator(_none_as_empty)] = Field(
        default_factory=dict, description="Options, validated by the plugin's Config model."
    )
    needs: list[NodeId] = Field(
        default_factory=list,
        description="Ids of nodes this node depends on (e.g. a model tracker).",
    )
    role: NodeRole | None = Field(
        None, description="load, save, both, transport or service; default: the plugin's own."
    )
    on_error: ErrorPolicy = Field(
        "fail",
        description="What a hook that raises does. fail: stop the engine. disable: switch "
        "the node off in every vLLM process; what it was loading is recomputed, what it held "
        "is released. recompute: a failed lookup or synchronous load is recomputed and the "
        "node stays; a fault anywhere else switches it off as disable does.",
    )
    enabled: bool = Field(
        True, description="false keeps the node in the file but out of the chain."
    )
    sides: Annotated[list[Side], Field(min_length=1)] | None = Field(
        None,
        description="The P/D sides this node runs on: producer (the prefill engine), "
        "consumer (the decode engine); default: both. A node is left out of an engine "
        "of the other side (a kv_both engine plays both sides).",
    )
    description: str = ""


class Pipeline(BaseModel):
    """A KV Composer pipeline file."""

    model_config = ConfigDict(extra="forbid", title="KV Composer pipeline")

    version: Annotated[Literal[1], BeforeValidator(_exactly_int)] = Field(
        description="Pipeline file format version."
    )
    kv_role: KVRole = Field(
        "kv_both",
        description="vLLM kv_role of the composed connector: the side this engine plays "
        "(kv_producer: prefill, kv_consumer: decode, kv_both). Where the pipeline runs may "
        "say it instead (kvc serve --kv-role), so one file serves both sides.",
    )
    nodes: dict[NodeId, Node] = Field(
        min_length=1, description="Nodes by id.", json_schema_extra=_NODES_SCHEMA
    )
    load_order: list[NodeId] | None = Field(
        None, description="Order in which nodes are asked for hits; default: file order."
    )
    load_policy: LoadPolicy = Field(
        "first_hit",
        description="first_hit: the first node with a hit serves it (MultiConnector's rule). "
        "longest_hit: the node with the most tokens serves it (ties: load order). "
        "ranges: each node in load order serves what it holds after the nodes before it, "
        "so one request loads [0, a) from the first, [a, b) from the next, and computes "
        "the rest.",
    )
    save_to: list[NodeId] | None = Field(
        None, description="Nodes that receive the save hooks; default: every node whose role saves."
    )
    hma: Literal["auto", "on", "off"] = Field(
        "auto", description="Hybrid memory allocator: on requires every node to support it."
    )
    annotate_outputs: bool = Field(
        False,
        description='Add {"kv_composer": {"served_by": node, "tokens": n}} to each finished '
        "request's kv_transfer_params, so callers see which node served it: the tokens that "
        'arrived in vLLM\'s KV cache (a load that lost blocks adds "failed").',
    )
    time_layer_hooks: bool = Field(
        False, description="Also time per-layer hooks in per-node stats (costs ~0.1 us per call)."
    )
    time_step_hooks: bool = Field(
        False,
        description="Also time the hooks vLLM calls every step (start_load_kv, wait_for_save, "
        "build_connector_meta, ...) in per-node stats (hook_seconds). Off by default: timing makes "
        "every step report every node's stats, ~15-25 us per node and step, while untimed "
        "per-step dispatch costs about what MultiConnector's does.",
    )
    trace: bool = Field(
        False,
        description="Log every hook call of every node, with its arguments and result, at "
        "debug level (pluggy's tracer, tag 'hook'). For debugging: it slows every call.",
    )


LOADING_ROLES: frozenset[str] = frozenset({"load", "both", "transport"})
SAVING_ROLES: frozenset[str] = frozenset({"save", "both", "transport"})


@dataclass(frozen=True)
class ResolvedNode:
    id: str
    plugin: PluginType
    config: BaseModel
    role: NodeRole
    on_error: ErrorPolicy
    needs: tuple[str, ...]
    capabilities: Capabilities
    #: The P/D sides it runs on (``sides`` in the file; default both).
    sides: tuple[Side, ...] = SIDES

    @property
    def allows_hma(self) -> bool:
        """Whether vLLM's hybrid KV cache manager may stay on for this node: it supports
        it, or it is a service node, which never touches a KV block."""
        return self.capabilities.hma or self.role == "service"


@dataclass(frozen=True)
class ResolvedPipeline:
    """A validated pipeline: nodes in dependency order plus the chain settings."""

    nodes: tuple[ResolvedNode, ...]
    load_order: tuple[str, ...]
    save_to: tuple[str, ...]
    load_policy: LoadPolicy
    kv_role: KVRole
    hma: bool
    time_layer_hooks: bool
    annotate_outputs: bool = False
    time_step_hooks: bool = False
    trace: bool = False
    #: The validated file as plain data (env expanded), for inlining into vLLM's config.
    source: dict[str, Any] = field(repr=False, default_factory=dict)
    file: str = "<pipeline>"

    def node(self, node_id: str) -> ResolvedNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)


def typed_pipeline_model(types: dict[str, PluginType]) -> type[BaseModel]:
    """The pipeline model with each plugin's own Config, for the exported JSON Schema."""
    variants = [
        create_model(
            f"Node_{name.replace('-', '_')}",
            __base__=Node,
            __doc__=ptype.description or f"A {name} node.",
            plugin=(_literal(name), Field(description=ptype.description)),
            config=(ptype.config, Field(default_factory=dict)),
        )
        for name, ptype in sorted(types.items())
    ]
    if not variants:
        return Pipeline
    union: Any = Annotated[Union[tuple(variants)], Field(discriminator="plugin")]  # noqa: UP007
    return create_model(
        "Pipeline",
        __base__=Pipeline,
        __doc__=Pipeline.__doc__,
        nodes=(
            dict[NodeId, union],
            Field(min_length=1, description="Nodes by id.", json_schema_extra=_NODES_SCHEMA),
        ),
    )


def _literal(value: str) -> Any:
    # A Literal built at run time; typed Any because no static type can name it.
    return Literal[value]
