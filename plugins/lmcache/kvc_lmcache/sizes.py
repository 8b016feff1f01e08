"""Sizes in the ``lmcache`` node's options, bounded as the core bounds every size: 1 EiB.

The core refuses a byte size over 1 EiB before launch (``PositiveByteSize``): no
machine holds that much memory or disk, so a larger size is a typo or a unit
gone wrong. LMCache's options are numbers of GB, which LMCache multiplies by
2**30 (``l1_size_gb * (1 << 30)``, ``max_local_cpu_size * 1024**3``): the same
bound, in those units. The core's types do not fit them (``PositiveByteSize``
reads a bare number as bytes, and refuses 0, which these options allow).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from composer import MAX_BYTE_SIZE, Int, Number

#: The core's largest size, 1 EiB.
MAX_BYTES: int = MAX_BYTE_SIZE
#: What LMCache calls a GB.
GIB = 2**30
#: 1 EiB in LMCache's GB.
MAX_GB = MAX_BYTES // GIB


def _gb_at_most_1eib(value: float) -> float:
    if value > MAX_GB:
        raise PydanticCustomError(
            "gb_size_too_large",
            "Expected a size of at most {max_gb} GB, which is 1 EiB: no machine holds more",
            {"max_gb": MAX_GB},
        )
    return value


def _bytes_at_most_1eib(value: int) -> int:
    if value > MAX_BYTES:
        raise PydanticCustomError(
            "bytes_too_large",
            "Expected a size of at most {max_bytes} bytes, which is 1 EiB: no machine holds more",
            {"max_bytes": MAX_BYTES},
        )
    return value


#: A size in LMCache's GB (2**30 bytes): a finite number, at most 1 EiB.
GB = Annotated[Number, AfterValidator(_gb_at_most_1eib)]
#: A size in bytes: an integer, at most 1 EiB.
Bytes = Annotated[Int, AfterValidator(_bytes_at_most_1eib)]


def shown(value: float) -> str:
    """A size option's value as a user would write it (``8``, ``0.5``, ``536870912``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
