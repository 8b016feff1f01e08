"""User-facing pipeline errors: where, what, and what would have been valid."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from composer.loader import Marks

Path = tuple[str | int, ...]


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
#: What a terminal would act on instead of showing: C0/C1 controls (newlines,
#: ANSI escapes), Unicode format characters (bidi overrides, zero-width, tags),
#: line/paragraph separators and lone surrogates (undecodable bytes).
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891"
    "\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb"
    "\ud800-\udfff\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: Longest list of names a message spells out.
MAX_LISTED = 20


def escape(text: str) -> str:
    """User text made safe for one line of human output, the way ``repr`` shows it.

    Every character that could end the line, recolour or move the cursor, or
    reorder what is shown becomes a visible escape (``\\n``, ``\\x1b``,
    ``\\u202e``): a key or plugin name cannot forge another ``file:line:`` line.
    """
    return _UNSAFE.sub(lambda m: _SHORT.get(m.group()) or _code(m.group()), text)


def _code(char: str) -> str:
    n = ord(char)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def dotted(path: Path) -> str:
    """``nodes.cpu.config.capacity``; list indexes and odd keys in brackets: ``save_to[0]``,
    ``nodes["my cache"]``, so that the path reads unambiguously whatever the keys are."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _NAME.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(str(part), ensure_ascii=False)}]"
    return out or "<root>"


#: Most names a did-you-mean hint compares against: each comparison is quadratic in
#: the names' length, and a file can ask once per node.
MAX_HINT_CHOICES = 200


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    names = [str(c) for c in choices]
    if len(names) > MAX_HINT_CHOICES or len(str(word)) > 200:
        return ""
    close = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def one_of(choices: Iterable[str]) -> str:
    names = sorted(str(c) for c in choices)
    shown = ", ".join(f'"{c}"' for c in names[:MAX_LISTED]) if names else "(none)"
    # A thousand-node pipeline would otherwise list every node in every message.
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a pipeline, located in its source file."""

    path: Path
    message: str
    file: str = "<pipeline>"
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = escape(self.file)
        if self.line is not None:
            where += f":{self.line}:{self.column}"
        return f"{where}: {escape(dotted(self.path))}: {escape(self.message)}"

    def as_dict(self) -> dict[str, object]:
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "path": dotted(self.path),
            "message": self.message,
        }


class PipelineInvalid(ValueError):
    """A pipeline has problems; all of them are in ``problems``, in file order."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = sorted(
            problems, key=lambda p: (p.file, p.line or 0, p.column or 0, dotted(p.path))
        )
        super().__init__("\n".join(str(p) for p in self.problems))


class Reporter:
    """Collects problems and locates them through the YAML marks of their file."""

    def __init__(self, file: str, marks: Marks) -> None:
        self.file = file
        self.marks = marks
        self.problems: list[Problem] = []
        #: Values already reported as unusable (e.g. an unset variable): checks of
        #: them, or of anything inside them, would only repeat that report.
        self.settled: set[Path] = set()

    def add(self, path: Path, message: str, *, key: bool = False) -> None:
        if any(path[: len(p)] == p for p in self.settled):
            return
        line, column = self.marks.locate(path, key=key)
        self.problems.append(Problem(path, message, self.file, line, column))

    def raise_if_any(self) -> None:
        if self.problems:
            raise PipelineInvalid(self.problems)
