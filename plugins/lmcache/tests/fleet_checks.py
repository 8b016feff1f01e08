"""What the fleet chaos tests check of an engine run, shared by their modules.

Each takes an :class:`EngineResult` and what the ``fleet-faults`` node
recorded in it (``kvc_fleet_faults.py``): which node served each request,
requests that stalled, KV blocks that did not come back, and what an outage
cost in requests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from composer.testing.engine import EngineResult, Prompt


def served(result: EngineResult, r: int) -> list[str | None]:
    """The node that served each request of round ``r`` (``annotate_outputs``), or None."""
    return [
        (x.kv_transfer_params or {}).get("kv_composer", {}).get("served_by")
        for x in result.rounds[r]
    ]


def stalled(latency: dict[str, float], mq_timeout: float) -> dict[str, float]:
    """Requests whose first lookup to ``request_finished`` took half of ``mq_timeout``
    or more: a wait on a store that is away (a lookup's ack, a store or retrieve
    in flight) lasts ``mq_timeout``; none of these requests comes near it otherwise.
    """
    return {r: round(s, 2) for r, s in latency.items() if s >= mq_timeout / 2}


def blocks_not_back(
    free: list[int], result: EngineResult, block_size: int, max_tokens: int
) -> str | None:
    """Why vLLM's free KV blocks did not come back, or None.

    ``free``: the free blocks at each request's first lookup, the first one
    before any request. The run must end with two rounds of one request each
    (sentinels): by the second's lookup every block lent before the first is
    back, except at most the first sentinel's own (held until its save is
    reported done, a step or more later).
    """
    assert [len(r) for r in result.rounds[-2:]] == [1, 1], "the run ends with two sentinels"
    sentinel = result.rounds[-2][0]
    its_own = -(-(sentinel.prompt_tokens + max_tokens) // block_size)
    if free[0] - its_own <= free[-1] <= free[0]:
        return None
    return (
        f"{free[0] - free[-1]} KV blocks not back at the last request (at most {its_own} "
        f"may still be held for the first sentinel's save); free at each lookup: {free}"
    )


def recomputed(result: EngineResult, rounds: Sequence[Sequence[Prompt]], window: range) -> int:
    """Requests in ``window``'s rounds that a store that never went away would have
    served: their prompt was computed in an earlier round of this run (so saved, or
    served), and it was computed again."""

    def key(prompt: Prompt) -> str:
        return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)

    seen = {key(p) for rnd in rounds[: window.start] for p in rnd}
    count = 0
    for r in window:
        by = served(result, r)
        count += sum(key(p) in seen and by[i] is None for i, p in enumerate(rounds[r]))
        seen.update(key(p) for p in rounds[r])
    return count
