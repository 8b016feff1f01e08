"""What the running vLLM asks of a connector that this KV Composer does not answer.

``ComposedConnector`` overrides every public member of the ``KVConnectorBase_V1``
it was written against (``tests/test_connector_surface.py``). A later vLLM
release adds members (0.33 added sleep mode's three); one the composed
connector does not override is inherited with vLLM's default, so no node is
asked. For a method that is a silent skip; for a gate (``supports_*``,
``requires_*``) it is worse: vLLM's default answers for the whole pipeline,
as 0.33's ``supports_sleep_mode`` said yes for pipelines holding a connector
that refuses sleep mode. So at connector start an unknown gate refuses the
engine, and every other unknown member is named in one warning.
"""

from __future__ import annotations

import inspect
from typing import Any

#: Members whose answer vouches for every node: never inherited silently.
GATE_PREFIXES = ("supports_", "requires_")


class UnknownGate(RuntimeError):
    """vLLM asks the connector a yes/no question KV Composer cannot answer for its nodes."""


def unknown_members(composed: type, base: type) -> list[str]:
    """Public members of ``base`` that no class of ``composed`` above ``base`` defines."""
    own = composed.__mro__[: composed.__mro__.index(base)]
    return sorted(
        name
        for name in dir(base)
        if not name.startswith("_") and not any(name in cls.__dict__ for cls in own)
    )


def what_vllm_does(base: type, name: str) -> str:
    """What inheriting ``base.name`` does: the chain keeps vLLM's default."""
    member = inspect.getattr_static(base, name)
    if isinstance(member, property):
        kind = "property"
    elif isinstance(member, classmethod | staticmethod):
        kind = "class-level method"
    else:
        kind = "method" if callable(member) else "attribute"
    return f"{name} ({kind}): vLLM's default of {base.__name__}, no node is asked"


def check_surface(composed: type, base: type, log: Any) -> list[str]:
    """Refuse an unknown gate; warn once naming every other unknown member. Returns them."""
    unknown = unknown_members(composed, base)
    gates = [n for n in unknown if n.startswith(GATE_PREFIXES)]
    if gates:
        raise UnknownGate(
            f"this vLLM's {base.__name__} has {', '.join(gates)}, which KV Composer does not "
            f"answer for its nodes; inheriting vLLM's default would answer for every node "
            "unasked. Use a vLLM release KV Composer supports (see the README), or a KV "
            "Composer that knows this release."
        )
    if unknown:
        log.warning(
            "this vLLM's connector API has members KV Composer does not know; the composed "
            "connector keeps vLLM's default for each, so no node is called for them",
            members=[what_vllm_does(base, n) for n in unknown],
        )
    return unknown
