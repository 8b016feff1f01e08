"""The ``offload-cpu`` node's options (validated before vLLM starts)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ByteSize, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from composer import Int, PolicyName, PolicyOptions, PositiveByteSize, cache_salt_problem


def _tenant(name: str) -> str:
    """A quota's tenant: a cache_salt vLLM accepts (``*``: every tenant not named)."""
    problem = cache_salt_problem(name)
    if problem is not None:
        raise PydanticCustomError(
            "tenant", "tenant {name}: {problem}", {"name": repr(name), "problem": problem}
        )
    return name


class OffloadCPUConfig(BaseModel):
    """A CPU memory tier for whole KV cache blocks, keyed by a chained hash of their tokens."""

    model_config = ConfigDict(extra="forbid")

    capacity: PositiveByteSize = Field(
        default=ByteSize(4 * 1024**3),
        description=(
            "Host memory of the block pool per worker, e.g. 8GiB. Slots = capacity // bytes "
            "of one KV block (all layers); the pool is preallocated and never grows."
        ),
    )
    save: Literal["prompt", "all"] = Field(
        default="prompt",
        description=(
            '"prompt": store the full blocks of the prompt only; '
            '"all": also the full blocks produced while decoding.'
        ),
    )
    min_blocks: Int = Field(
        default=1,
        ge=1,
        description="Serve a hit only when at least this many blocks can be loaded.",
    )
    load_mode: Literal["sync", "async"] = Field(
        default="sync",
        description=(
            '"sync": blocks are copied into vLLM\'s cache before the forward that needs them; '
            '"async": vLLM\'s async-load protocol (the request waits while a background '
            "thread copies, then reports it finished)."
        ),
    )
    save_mode: Literal["sync", "async"] = Field(
        default="async",
        description=(
            '"async": saves run on a background thread and overlap the next forward '
            "(a finished request's blocks are held until saved); "
            '"sync": saves finish inside wait_for_save.'
        ),
    )
    window_retention: Int = Field(
        default=512,
        ge=0,
        description=(
            "Hybrid models: tokens between the hit points kept for sliding-window and "
            "chunked-local KV cache groups. Such a group needs only the blocks inside the "
            "window before a hit's end, so the tier keeps those at every multiple of this "
            "many tokens and at the end of each prompt (0: prompt ends only); a window at "
            "least this long keeps every block. Larger: less memory, fewer shared-prefix "
            "hits. Full-attention groups keep every block."
        ),
    )
    events: bool = Field(
        default=True,
        description=(
            "Publish vLLM KV cache events for the tier: BlockStored when a block is saved, "
            "BlockRemoved when it is evicted, dropped, reset or the node shuts down, "
            'medium "CPU", vLLM\'s own block hashes and payload (as its OffloadingConnector '
            "gives its CPU tier), so a router indexing vLLM's events sees the tier. Only while "
            "vLLM publishes events (--kv-events-config with enable_kv_cache_events); "
            "otherwise nothing is built. false: never."
        ),
    )
    promote: Literal["on_hit", "never"] = Field(
        default="on_hit",
        description=(
            "Blocks another node loaded into a request (a slower tier behind this one, "
            'under load_policy: ranges or any other): "on_hit" saves them here too, like the '
            "blocks vLLM computes, so the next request finds them in this tier; the copy runs "
            "after the forward that needed them, never delaying that request. "
            '"never": only blocks vLLM computed are saved here.'
        ),
    )
    store_threshold: Int = Field(
        default=1,
        ge=1,
        description=(
            "Admission: save a block only once this many requests have contained it (1: on "
            "first sight; 2: a prompt seen once never takes room). As vLLM's "
            "OffloadingConnector's store_threshold; counts are kept for the last "
            "4 x slots blocks seen."
        ),
    )
    eviction: Annotated[str, PolicyName("eviction")] = Field(
        default="lru",
        description=(
            "The eviction policy, which orders the blocks that may go when the tier is full: "
            "an installed cache policy by name (kvc plugins lists them)."
        ),
    )
    eviction_options: PolicyOptions = Field(
        default_factory=dict,
        description=(
            "The eviction policy's options, as the policy declares them (kvc plugins lists "
            "each policy's); validated against the policy named in eviction. The built-ins "
            "take none."
        ),
    )
    retention: Annotated[str, PolicyName("retention")] = Field(
        default="request",
        description=(
            "The retention policy, deciding which blocks must stay: an installed cache "
            'policy by name. Built in: "request": what each request\'s kv_retention asks '
            "({ttl_s, pin, priority} in its kv_transfer_params)."
        ),
    )
    retention_options: PolicyOptions = Field(
        default_factory=dict,
        description=(
            "The retention policy's options, as the policy declares them; validated against "
            "the policy named in retention. The built-in request takes none (its setting is "
            "max_pinned_share)."
        ),
    )
    max_pinned_share: float = Field(
        default=0.25,
        gt=0,
        le=0.9,
        description=(
            "The share of the tier's blocks requests may pin (kv_retention pin: true); a pin "
            "past it is not granted (counted as pins_refused), so pins cannot fill the tier."
        ),
    )
    quotas: dict[
        Annotated[str, AfterValidator(_tenant)],
        Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)],
    ] = Field(
        default_factory=dict,
        description=(
            "Per-tenant shares of the tier, keyed by vLLM's cache_salt (the tenant a request "
            'names): {"chat": 0.6, "batch": 0.3}; "*" is every tenant not named (and requests '
            "without a salt), with what the named shares leave unless given. When the tier is "
            "full a tenant at its share evicts its own blocks first, never a block of a tenant "
            "within its share; free slots are anyone's. Shares sum to at most 1. Each named "
            "tenant's blocks held, tokens served and blocks evicted are on /metrics."
        ),
    )
    admission: Annotated[str, PolicyName("admission")] = Field(
        default="threshold",
        description=(
            "The admission policy: an installed cache policy by name, asked once per request "
            'how many of its blocks take room. Built in: "threshold" (store_threshold).'
        ),
    )
    admission_options: PolicyOptions = Field(
        default_factory=dict,
        description=(
            "The admission policy's options, as the policy declares them; validated against "
            "the policy named in admission. The built-in threshold takes none (its setting "
            "is store_threshold)."
        ),
    )
    checksums: bool = Field(
        default=False,
        description=(
            "Checksum every block at save and verify it at load; a mismatch becomes a load "
            "error and vLLM recomputes the block."
        ),
    )

    @field_validator("quotas")
    @classmethod
    def _shares(cls, quotas: dict[str, float]) -> dict[str, float]:
        total = sum(quotas.values())
        if total > 1 + 1e-9:
            raise PydanticCustomError(
                "quota_sum", "the shares sum to {total}; at most 100%", {"total": f"{total:.0%}"}
            )
        return quotas
