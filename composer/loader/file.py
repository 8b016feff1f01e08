"""Reading a pipeline file as text, refusing what is not a small regular UTF-8 file."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

#: Largest pipeline file read, in bytes; pipelines are a few kilobytes.
MAX_FILE_BYTES = 1024 * 1024


class FileProblem(Exception):
    """A pipeline file that cannot be read as text; ``line``/``column`` where known."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


def read_pipeline_file(path: str | os.PathLike[str]) -> str:
    """The file's text, refusing what is not a regular UTF-8 file of at most
    :data:`MAX_FILE_BYTES` before reading more than that.

    Non-blocking open: a FIFO without a writer would otherwise block forever,
    and a device such as /dev/zero never ends.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise FileProblem(f"cannot read pipeline file: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "Is a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise FileProblem(f"cannot read pipeline file: {kind}")
        if info.st_size > MAX_FILE_BYTES:
            raise FileProblem(_too_large(info.st_size))
        data = _read_at_most(fd, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise FileProblem(f"cannot read pipeline file: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # it grew while being read
        raise FileProblem(_too_large(len(data)))
    return decode_pipeline(data)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_pipeline_stream(stream: BinaryIO) -> str:
    """Like :func:`read_pipeline_file` for an open stream (stdin), which may be a pipe."""
    data = stream.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise FileProblem(_too_large(None))
    return decode_pipeline(data)


def _too_large(size: int | None) -> str:
    got = f"{size:,} bytes" if size is not None else "more"
    return f"pipeline file too large ({got}; at most {MAX_FILE_BYTES:,} bytes are read)"


def decode_pipeline(data: bytes) -> str:
    """Strict UTF-8 (a BOM allowed), located at the first undecodable byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        column = len(data[line_start : exc.start].decode("utf-8", errors="replace")) + 1
        raise FileProblem(
            f"pipeline file is not UTF-8 text: byte 0x{data[exc.start]:02x} cannot be decoded",
            data.count(b"\n", 0, exc.start) + 1,
            column,
        ) from None
