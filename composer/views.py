"""Small, stable views of vLLM objects handed to lifecycle hooks.

A plugin written against these should survive a vLLM upgrade; ``raw`` is the
escape hatch to the vLLM object itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer.controls import Controls, controls_of
from composer.ranges import Range


class RequestView:
    """A request as the scheduler sees it. Attributes read through to vLLM lazily; its
    tier controls are parsed once. Inside the chain a request has one view, from
    vLLM's first call about it to its end (:class:`RequestViews`)."""

    __slots__ = ("raw", "loads", "_controls")

    def __init__(self, raw: Any, loads: tuple[Range, ...] = ()) -> None:
        self.raw = raw
        #: From ``update_state_after_alloc`` on: the request's load, its ranges in order
        #: (:class:`~composer.ranges.Range`: ``node``, ``start``, ``tokens``, the
        #: ``blocks`` it writes); empty when nothing is loaded.
        self.loads = loads
        self._controls: Controls | None = None

    @property
    def request_id(self) -> str:
        return self.raw.request_id

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.raw.prompt_token_ids or ()

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt plus generated tokens so far."""
        return self.raw.all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.raw.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.raw.num_tokens

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """vLLM's chained hash of each full block of tokens (same in every process)."""
        return getattr(self.raw, "block_hashes", ()) or ()

    @property
    def tenant(self) -> str:
        """Whose request it is: vLLM's ``cache_salt`` (the tenant boundary vLLM hashes
        into its block keys); "" without one."""
        return getattr(self.raw, "cache_salt", None) or ""

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return getattr(self.raw, "kv_transfer_params", None)

    @property
    def controls(self) -> Controls:
        """The request's tier controls (``kv_load_tiers``, ``kv_store_tiers``,
        ``max_offload_tokens``; see :mod:`composer.controls`), parsed at the first read."""
        if self._controls is None:
            self._controls = controls_of(self.kv_transfer_params)
        return self._controls

    def store_limit(self, node_id: str) -> int | None:
        """How many of the request's first tokens node ``node_id`` may save; None: all."""
        return self.controls.store_limit(node_id)

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, {self.num_tokens} tokens)"


class RequestViews:
    """One :class:`RequestView` per request: made when vLLM first shows the request to the
    chain, dropped when it finishes (``drop``)."""

    __slots__ = ("_views",)

    def __init__(self) -> None:
        self._views: dict[str, RequestView] = {}

    def of(self, request: Any) -> RequestView:
        """The request's view (a new one for a request object the chain has not seen)."""
        view = self._views.get(request.request_id)
        if view is None or view.raw is not request:
            view = self._views[request.request_id] = RequestView(request)
        return view

    def drop(self, request_id: str) -> None:
        self._views.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._views)


class ScheduledRequest:
    """One request in a scheduler step."""

    __slots__ = (
        "request_id",
        "is_new",
        "resumed",
        "block_ids",
        "num_computed_tokens",
        "num_scheduled_tokens",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        *,
        is_new: bool,
        resumed: bool,
        block_ids: tuple[list[int], ...] | None,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        token_ids: Sequence[int] | None,
    ) -> None:
        self.request_id = request_id
        self.is_new = is_new
        self.resumed = resumed
        #: New requests: all their block ids per group; running ones: blocks added this step.
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.num_scheduled_tokens = num_scheduled_tokens
        #: New requests: the prompt; running ones: all tokens when vLLM sends them, else None.
        self.token_ids = token_ids

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request_id!r}, new={self.is_new}, "
            f"computed={self.num_computed_tokens}, scheduled={self.num_scheduled_tokens})"
        )


class StepView:
    """A scheduler step (vLLM's ``SchedulerOutput``), read lazily and once."""

    __slots__ = ("raw", "_requests")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self._requests: list[ScheduledRequest] | None = None

    @property
    def requests(self) -> list[ScheduledRequest]:
        if self._requests is None:
            self._requests = list(self._build())
        return self._requests

    @property
    def preempted_request_ids(self) -> set[str]:
        return self.raw.preempted_req_ids or set()

    def _build(self) -> Any:
        out = self.raw
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            yield ScheduledRequest(
                new.req_id,
                is_new=True,
                resumed=False,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=scheduled.get(new.req_id, 0),
                token_ids=new.prompt_token_ids,
            )
        cached = out.scheduled_cached_reqs
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        for i, req_id in enumerate(cached.req_ids):
            yield ScheduledRequest(
                req_id,
                is_new=False,
                resumed=req_id in cached.resumed_req_ids,
                block_ids=cached.new_block_ids[i],
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=scheduled.get(req_id, 0),
                token_ids=all_tokens.get(req_id),
            )
