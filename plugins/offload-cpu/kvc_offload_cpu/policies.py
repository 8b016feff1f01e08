"""The tier's cache policies as in force: a policy that raises is switched off and
replaced by its fallback (:data:`FALLBACKS`), said once on the log in one line naming
the policy, the method and the error, and reported from then on
(:class:`PolicyHealth`); and the admission policy, as the tier asks it
(:class:`Admission`). The eviction and retention policies are the index's
(:class:`~kvc_offload_cpu.index.BlockIndex`), which tells :class:`PolicyHealth` when
one raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from composer import POLICY_KINDS as KINDS
from composer import AdmissionPolicy, find_policy
from composer import PolicyKind as Kind

log = structlog.get_logger("kv_composer")


#: What replaces a policy of each kind that raised.
FALLBACKS: dict[Kind, str] = {
    "eviction": "lru",
    "admission": "every block admitted",
    "retention": "no block kept",
}


@dataclass(frozen=True)
class PolicyFallback:
    """A cache policy switched off at run time: one of its methods raised."""

    kind: Kind
    #: The policy as the node config names it (``lfu``; a class name for one given as
    #: an object).
    policy: str
    #: Its class, and the method that raised (``admit``, ``victims``, ``kept``, ...).
    cls: str
    hook: str
    #: ``RuntimeError: boom``, on one line.
    error: str
    #: What the tier does instead (:data:`FALLBACKS`).
    fallback: str
    #: The tier's evictions (slots) when it was switched off: the figures before are
    #: the policy's, those after its fallback's.
    evictions: int

    @property
    def in_force(self) -> str:
        """``lfu → lru after 1,203 evictions``."""
        n = self.evictions
        return f"{self.policy} → {self.fallback} after {n:,} eviction{'s' * (n != 1)}"

    @property
    def reason(self) -> str:
        """``Lfu.removed raised RuntimeError: boom``."""
        return f"{self.cls}.{self.hook} raised {self.error}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "in_force": self.in_force}


class PolicyHealth:
    """A tier's cache policies, as its config names them and as in force.

    A policy that raises is switched off by its caller (the index, :class:`Admission`),
    which tells :meth:`failed`: the switch is recorded (the first of each kind: a
    fallback never raises), said on the log in one line naming the policy, the
    method and the error, and handed to ``on_fallback`` (the scheduler half counts
    it on the node's stats)."""

    def __init__(self, evictions: Callable[[], int] = lambda: 0) -> None:
        #: Each kind's policy by the name the node config gives it.
        self.configured: dict[Kind, str] = {}
        #: The policies switched off, by kind.
        self.fallbacks: dict[Kind, PolicyFallback] = {}
        #: Called with every switch (after it is recorded and logged).
        self.on_fallback: Callable[[PolicyFallback], None] | None = None
        self._evictions = evictions

    def failed(self, kind: Kind, policy: object, hook: str, exc: BaseException) -> PolicyFallback:
        """``policy`` (a policy of ``kind``) raised ``exc`` in ``hook``: its caller switches
        it to the fallback."""
        error = f"{type(exc).__name__}: {exc}".replace("\r", "\\r").replace("\n", "\\n")
        fallback = PolicyFallback(
            kind=kind,
            policy=self.configured.get(kind, type(policy).__name__),
            cls=type(policy).__name__,
            hook=hook,
            error=error,
            fallback=FALLBACKS[kind],
            evictions=self._evictions(),
        )
        self.fallbacks.setdefault(kind, fallback)
        # One line (the error's own line breaks escaped), on the log's stream: stderr
        # in every kvc command, never a command's output.
        log.error(
            f"cache policy {fallback.policy} ({kind}) switched off: {fallback.reason}; "
            f"the tier goes on with {fallback.fallback}",
            policy=fallback.policy,
            kind=kind,
            hook=hook,
            error=error,
            evictions=fallback.evictions,
        )
        if self.on_fallback is not None:
            self.on_fallback(fallback)
        return fallback

    def in_force(self) -> dict[str, str]:
        """Each kind's policy in force: its name, or how it was switched off
        (``lfu → lru after 1,203 evictions``)."""
        return {
            kind: self.fallbacks[kind].in_force if kind in self.fallbacks else self.configured[kind]
            for kind in KINDS
            if kind in self.configured
        }


class Admission:
    """The admission policy the node config names (``admission``), asked once per request
    the tier would save. One that raises is replaced by admitting every block (as
    ``store_threshold: 1``), told to ``health`` (the tier's index's: one report of
    the tier's policies)."""

    def __init__(
        self, name: str, num_slots: int, config: Any = None, health: PolicyHealth | None = None
    ) -> None:
        self.policy: AdmissionPolicy | None = find_policy("admission", name)(num_slots, config)
        self.health = health if health is not None else PolicyHealth()
        self.health.configured["admission"] = name

    @property
    def failed(self) -> str:
        """Why the configured policy was switched off ("": it was not)."""
        fallback = self.health.fallbacks.get("admission")
        return fallback.reason if fallback is not None else ""

    def admit(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a request's blocks, in order) to save, from the first."""
        if self.policy is None:
            return len(keys)
        try:
            return max(0, min(len(keys), int(self.policy.admit(keys))))
        except Exception as exc:
            policy, self.policy = self.policy, None
            self.health.failed("admission", policy, "admit", exc)
            return len(keys)
