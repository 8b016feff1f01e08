"""Small, stable views of vLLM objects handed to lifecycle hooks.

A plugin written against these should survive a vLLM upgrade; ``raw`` is the
escape hatch to the vLLM object itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RequestView:
    """A request as the scheduler sees it. Attributes read through to vLLM lazily."""

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    @property
    def request_id(self) -> str:
        return self.raw.request_id  # type: ignore[no-any-return]

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.raw.prompt_token_ids or ()  # type: ignore[no-any-return]

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt plus generated tokens so far."""
        return self.raw.all_token_ids  # type: ignore[no-any-return]

    @property
    def num_prompt_tokens(self) -> int:
        return self.raw.num_prompt_tokens  # type: ignore[no-any-return]

    @property
    def num_tokens(self) -> int:
        return self.raw.num_tokens  # type: ignore[no-any-return]

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """vLLM's chained hash of each full block of tokens (same in every process)."""
        return getattr(self.raw, "block_hashes", ()) or ()

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return getattr(self.raw, "kv_transfer_params", None)

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, {self.num_tokens} tokens)"
