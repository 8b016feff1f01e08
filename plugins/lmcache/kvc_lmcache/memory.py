"""Whether an LMCache L1 the node is about to have allocated fits, asked before it is.

An L1 (a started server's, or an in-process engine's CPU buffer) larger than the
memory left is an OOM kill once it fills, minutes into serving, or a failed
start. Checked at node start instead, it is an error that says so. The memory
is the core's reading (:func:`composer.available_memory`), looked up here at
each call so that tests can stand in for it.
"""

from __future__ import annotations

from pydantic import ByteSize

from composer import available_memory


def check_fits(what: str, size: int, advice: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` when ``size`` bytes do not fit in the memory available now:
    "{what} is more than the ... of memory available on this machine (... in all); {advice}"."""
    available, total = available_memory()
    if size <= available:
        return
    raise error(
        f"{what} is more than the {human(available)} of memory available on this machine "
        f"({human(total)} in all); {advice}"
    )


def human(n: int) -> str:
    """Bytes as the core writes sizes (``4.0GiB``)."""
    return ByteSize(n).human_readable(decimal=False)
