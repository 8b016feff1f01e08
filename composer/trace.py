"""Request traces: reading Mooncake's format, and the block keys of a request.

Traces are Mooncake's format (one JSON object a line: ``input_length``,
``output_length``, ``hash_ids``, one id per 512-token prompt block, equal
leading ids meaning an equal prefix; ``timestamp`` optional), with two optional
fields of ours: ``tenant`` (a string, sent as vLLM's ``cache_salt``: a
tenant's blocks are its own, equal ids or not) and ``kv_retention`` (what the
request asks of the tiers, as in its ``kv_transfer_params``:
:class:`composer.controls.Retention`). Each id stands
for ``trace_block_tokens`` tokens (512 by default; fewer rescales every length
by the same factor, as a scaled replay on a CPU does). The partial last block
of a prompt and the output are unique to their request. ``kvc simulate``
(:mod:`composer.simulate`) and ``kvc bench`` (:mod:`composer.bench.replay`) read
traces through here.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.controls import RETENTION, Retention, cache_salt_problem, controls_of

#: Tokens per hash id in Mooncake's traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Bit that marks a key unique to one request (partial last prompt block, output).
_UNIQUE = 1 << 63
_OFFSET_BITS = 24
#: A trace block's tokens must fit the offset bits of a key.
MAX_TRACE_BLOCK_TOKENS = 1 << _OFFSET_BITS


class TraceError(Exception):
    """A bad trace line: ``file:line: message``."""

    def __init__(self, file: str, line: int | None, message: str) -> None:
        self.file, self.line, self.message = file, line, message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    #: Arrival, milliseconds from the trace's start (0 where the line has none).
    timestamp_ms: float = 0.0
    #: Whose request it is (vLLM's ``cache_salt``; "": no salt).
    tenant: str = ""
    #: Its ``kv_retention`` (None: it asks nothing).
    retention: Retention | None = None


def _int_field(obj: dict[str, Any], name: str, file: str, line: int, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(file, line, f"{name}: expected an integer, got {json.dumps(value)}")
    if value < minimum:
        raise TraceError(file, line, f"{name}: must be >= {minimum}, got {value}")
    return value


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    file = str(path)
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise TraceError(file, None, f"cannot read trace: {exc.strerror or exc}") from None
    requests: list[TraceRequest] = []
    with handle:
        try:
            for number, text in enumerate(handle, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if not text.strip():
                    continue
                requests.append(_parse_line(text, file, number))
        except UnicodeDecodeError as exc:
            raise TraceError(file, None, f"not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise TraceError(file, None, "trace has no requests")
    return requests


def out_of_order(path: str | Path, requests: Sequence[TraceRequest]) -> str | None:
    """Where the timestamps of ``requests`` (:func:`read_trace`'s of ``path``) first go
    back, as ``file:line: ...`` with both timestamps and lines; None where they never do.
    Mooncake's traces are in timestamp order; two merged are not, and need not be: a
    replay in time sends each request at its own time, whatever its line."""
    stamps = [r.timestamp_ms for r in requests]
    back = [i for i in range(1, len(stamps)) if stamps[i] < stamps[i - 1]]
    if not back:
        return None
    i = back[0]
    lines = list(range(1, i + 2))  # (where the file cannot be read again: request numbers)
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [n for n, text in enumerate(handle, 1) if text.strip()][: i + 1]
    except (OSError, UnicodeDecodeError):
        pass
    return (
        f"{path}:{lines[i]}: timestamp {stamps[i]:g} ms is before line {lines[i - 1]}'s "
        f"{stamps[i - 1]:g} ms ({len(back)} {'line goes' if len(back) == 1 else 'lines go'} "
        "back in time)"
    )


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """``requests`` as a Mooncake-format JSONL trace (what :func:`read_trace` reads)."""
    lines = (json.dumps(_line(r)) for r in requests)
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _line(r: TraceRequest) -> dict[str, Any]:
    line: dict[str, Any] = {
        "timestamp": r.timestamp_ms,
        "input_length": r.input_length,
        "output_length": r.output_length,
        "hash_ids": list(r.hash_ids),
    }
    if r.tenant:
        line["tenant"] = r.tenant
    if r.retention is not None:
        line[RETENTION] = {
            "ttl_s": r.retention.ttl_s,
            "priority": r.retention.priority,
            **({"pin": r.retention.pin} if r.retention.pin is not None else {}),
        }
    return line


def _parse_line(text: str, file: str, number: int) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(file, number, f"not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(file, number, "expected a JSON object")
    input_length = _int_field(obj, "input_length", file, number, 1)
    output_length = _int_field(obj, "output_length", file, number, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise TraceError(file, number, "hash_ids: expected a list of integers >= 0")
    expected = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceError(
            file,
            number,
            f"hash_ids: {len(ids)} ids for {input_length} input tokens; expected {expected} "
            f"(one per {MOONCAKE_BLOCK_TOKENS}-token block)",
        )
    stamp = obj.get("timestamp", 0)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
        raise TraceError(
            file, number, f"timestamp: expected a number >= 0, got {json.dumps(stamp)}"
        )
    tenant = obj.get("tenant", "")
    problem = None if tenant == "" else cache_salt_problem(tenant)
    if problem is not None:
        raise TraceError(file, number, f"tenant: {problem}, got {json.dumps(tenant)[:60]}")
    controls = controls_of({RETENTION: obj.get(RETENTION)})
    if controls.error is not None:
        raise TraceError(file, number, controls.error)
    return TraceRequest(
        input_length, output_length, tuple(ids), float(stamp), tenant, controls.retention
    )


#: Leading trace blocks that name a request's conversation (:func:`conversation`).
CONVERSATION_BLOCKS = 3


def conversation(req: TraceRequest, blocks: int = CONVERSATION_BLOCKS) -> str:
    """The request's conversation, as far as a trace shows one: its first ``blocks``
    hash ids (a later turn of a chat repeats the earlier turns, so it starts with
    the same blocks; requests too short for them are their own conversation).
    Mooncake's traces carry no session ids; a client would send its own."""
    return "-".join(map(str, req.hash_ids[:blocks]))


def multi_turn(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The requests of ``trace`` whose conversation has another request in it (in
    trace order): a slice where turns come back, as a fleet's router must place them."""
    counts = Counter(conversation(r) for r in trace)
    return [
        r for r in trace if len(r.hash_ids) >= CONVERSATION_BLOCKS and counts[conversation(r)] > 1
    ]


class KeyMaker:
    """Block keys of trace requests for a given vLLM block size.

    The key of block ``k`` names the whole prefix ``[0, (k + 1) * block_size)``:
    the request's tenant, the chain of hash ids up to the trace block holding
    its last token, and where in that trace block it ends. Equal prefixes of
    one tenant give equal keys, in any request (vLLM hashes ``cache_salt`` into
    the first block's key, so two tenants share none).
    """

    def __init__(self, block_size: int, trace_block_tokens: int) -> None:
        if block_size < 1 or trace_block_tokens < 1:
            raise ValueError("block size and trace block tokens must be >= 1")
        if trace_block_tokens >= MAX_TRACE_BLOCK_TOKENS:
            raise ValueError(f"trace block tokens must be < {MAX_TRACE_BLOCK_TOKENS}")
        self.block_size = block_size
        self.trace_block_tokens = trace_block_tokens
        #: (parent chain id, hash id) -> chain id; a tenant's root is (-1, its number).
        self._chains: dict[tuple[int, int], int] = {}
        self._tenants: dict[str, int] = {"": 0}
        self._unique = 0

    def scale(self, tokens: int) -> int:
        return tokens * self.trace_block_tokens // MOONCAKE_BLOCK_TOKENS

    def prompt_tokens(self, req: TraceRequest) -> int:
        full, rest = divmod(req.input_length, MOONCAKE_BLOCK_TOKENS)
        return full * self.trace_block_tokens + self.scale(rest)

    def keys(self, req: TraceRequest, num_tokens: int) -> list[bytes]:
        """Keys of the full blocks of the first ``num_tokens`` tokens of ``req``'s sequence."""
        bs, tbt = self.block_size, self.trace_block_tokens
        full_trace = req.input_length // MOONCAKE_BLOCK_TOKENS
        chains = self._chains
        chain_ids: list[int] = []
        parent = 0
        if req.tenant:
            number = self._tenants.setdefault(req.tenant, len(self._tenants))
            root = (-1, number)
            parent = chains.get(root) or chains.setdefault(root, len(chains) + 1)
        for hid in req.hash_ids[:full_trace]:
            pair = (parent, hid)
            cid = chains.get(pair)
            if cid is None:
                cid = chains[pair] = len(chains) + 1
            chain_ids.append(cid)
            parent = cid
        keys: list[bytes] = []
        shared_end = full_trace * tbt
        n = num_tokens // bs
        for k in range(n):
            end = (k + 1) * bs
            if end <= shared_end:
                j = (end - 1) // tbt
                value = (chain_ids[j] << _OFFSET_BITS) | (end - j * tbt)
            else:
                self._unique += 1
                value = _UNIQUE | self._unique
            keys.append(value.to_bytes(8, "little"))
        return keys
