"""What a replay reports (:func:`composer.simulate.simulate`'s :class:`Result`): each node's
figures, each tenant's, the totals, and each cache policy switched off on the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.simulate.tiers import SimKVGroup


@dataclass
class NodeResult:
    id: str
    plugin: str
    modelled: bool
    lookup: bool = False
    save: bool = False
    capacity_blocks: int | None = None
    capacity_bytes: int | None = None
    lookups: int = 0
    hits: int = 0
    served_requests: int = 0
    tokens_served: int = 0
    blocks_loaded: int = 0
    blocks_saved: int = 0
    evictions: int = 0
    fraction_served: float = 0.0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    bytes_saved_per_request: float = 0.0
    #: Bytes kept ÷ bytes a full-attention model of the same shape would keep (window groups).
    window_saving: float | None = None
    #: Why the node serves nothing (a mamba hybrid), or "".
    note: str = ""
    #: Each kind's cache policy in force at the end (a model that has policies):
    #: ``{"eviction": "lfu → lru after 1,203 evictions", "admission": "threshold"}``.
    policies: dict[str, str] = field(default_factory=dict)
    #: Each policy switched off because it raised: kind, policy, cls, hook, error,
    #: fallback, evictions (when), in_force.
    policy_fallbacks: list[dict[str, Any]] = field(default_factory=list)


def fallback_line(node_id: str, fallback: dict[str, Any]) -> str:
    """A policy switched off, as ``kvc simulate`` says it: ``cpu: eviction policy
    lfu → lru after 1,203 evictions (Lfu.removed raised RuntimeError: boom)``."""
    get = fallback.get
    return (
        f"{node_id}: {get('kind', '?')} policy {get('in_force', get('policy', '?'))} "
        f"({get('cls', '?')}.{get('hook', '?')} raised {get('error', '?')})"
    )


@dataclass
class TenantResult:
    """Some requests' prompt tokens and what was served of them: one tenant's (vLLM's
    ``cache_salt``, the trace's ``tenant``; "": none), or one engine's of a fleet."""

    requests: int = 0
    prompt_tokens: int = 0
    #: Prompt tokens served, by vLLM's prefix cache and every node.
    tokens_served: int = 0

    @property
    def fraction_served(self) -> float:
        return self.tokens_served / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "fraction_served": self.fraction_served}


@dataclass
class Result:
    trace: str
    requests: int
    prompt_tokens: int
    block_size: int
    unit_blocks: int
    trace_block_tokens: int
    bytes_per_block: int
    load_policy: str
    nodes: list[NodeResult] = field(default_factory=list)
    groups: list[SimKVGroup] = field(default_factory=list)
    #: What the sizes had to assume, and why the replay moved the units it did.
    notes: list[str] = field(default_factory=list)
    tokens_served: int = 0
    prefill_tokens_computed: int = 0
    fraction_served: float = 0.0
    #: Per tenant (the trace's ``tenant``), when the trace names any.
    tenants: dict[str, TenantResult] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "block_size": self.block_size,
            "unit_blocks": self.unit_blocks,
            "trace_block_tokens": self.trace_block_tokens,
            "bytes_per_block": self.bytes_per_block,
            "load_policy": self.load_policy,
            "groups": [g.as_dict() for g in self.groups],
            "notes": self.notes,
            "nodes": [vars(n) for n in self.nodes],
            "total": {
                "tokens_served": self.tokens_served,
                "fraction_served": self.fraction_served,
                "prefill_tokens_saved": self.tokens_served,
                "prefill_tokens_computed": self.prefill_tokens_computed,
            },
            "tenants": {name: t.as_dict() for name, t in self.tenants.items()},
        }

    @property
    def policy_failures(self) -> list[str]:
        """Each cache policy switched off in the run (:func:`fallback_line`)."""
        return [fallback_line(n.id, f) for n in self.nodes for f in n.policy_fallbacks]
