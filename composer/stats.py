"""Per-node counters, reported through vLLM's connector stats under each node id."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class NodeStats:
    lookups: int = 0
    hits: int = 0
    tokens_hit: int = 0
    tokens_loaded: int = 0
    tokens_saved: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    errors: int = 0
    disabled: bool = False
    hook_seconds: dict[str, float] = field(default_factory=dict)
    #: Plugin-specific counters (evictions, pool use, ...).
    extra: dict[str, float] = field(default_factory=dict)

    def add_time(self, hook: str, seconds: float) -> None:
        self.hook_seconds[hook] = self.hook_seconds.get(hook, 0.0) + seconds

    def take(self) -> dict[str, object]:
        """The counters since the last call, as plain data; resets them."""
        snapshot = asdict(self)
        disabled = self.disabled
        self.__init__()  # type: ignore[misc]
        self.disabled = disabled
        return snapshot

    def is_empty(self) -> bool:
        return not any(
            (
                self.lookups,
                self.tokens_loaded,
                self.tokens_saved,
                self.errors,
                self.hook_seconds,
                self.extra,
            )
        )


def merge(a: dict[str, object], b: dict[str, object]) -> dict[str, object]:
    """Add two snapshots of the same node (from two steps or two workers)."""
    out: dict[str, object] = dict(a)
    for key, value in b.items():
        old = out.get(key)
        if isinstance(value, dict):
            merged = dict(old) if isinstance(old, dict) else {}
            for k, v in value.items():
                merged[k] = merged.get(k, 0) + v
            out[key] = merged
        elif isinstance(value, bool):
            out[key] = bool(old) or value
        elif isinstance(value, int | float) and isinstance(old, int | float):
            out[key] = old + value
        else:
            out[key] = value
    return out
