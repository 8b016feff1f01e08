"""Work counted, not timed: what a busy, shared machine does not change."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


@contextmanager
def opcodes() -> Iterator[list[int]]:
    """The Python opcodes run inside the block, counted in ``count[0]`` (``sys.settrace``
    with ``f_trace_opcodes``); what C code does in one call counts as one."""
    count = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            count[0] += 1
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield count
    finally:
        sys.settrace(previous)
