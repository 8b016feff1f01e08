"""Where every value of a pipeline file came from: ``path -> (line, column)`` as an
editor counts them (:class:`Marks`), from YAML's own marks (:class:`Positions`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

Path = tuple[str | int, ...]


@dataclass
class Marks:
    """``path -> (line, column)`` of each value (and of each mapping key), 1-based."""

    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def locate(self, path: Path, *, key: bool = False) -> tuple[int | None, int | None]:
        # Fall back to the nearest ancestor that has a mark: a missing key is
        # reported where its parent mapping starts.
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            if key and end == len(path) and prefix in self.keys:
                return self.keys[prefix]
            if prefix in self.values:
                return self.values[prefix]
        return None, None


class Positions:
    """Editor positions (lines end at ``\\n`` only, as grep, vim and less count them)
    for YAML's marks.

    YAML also ends a line at a lone ``\\r``, U+0085, U+2028 and U+2029, so past
    one of those its line numbers are not the ones an editor shows.
    """

    _UNUSUAL_BREAK = re.compile("\r(?!\n)|[\x85\u2028\u2029]")
    _YAML_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")

    def __init__(self, text: str) -> None:
        self.text = text
        # Start offset of each YAML line; None when YAML's lines are the editor's.
        self._starts: list[int] | None = None
        if self._UNUSUAL_BREAK.search(text):
            self._starts = [0] + [m.end() for m in self._YAML_BREAK.finditer(text)]

    def of(self, mark: yaml.Mark) -> tuple[int, int]:
        """1-based (line, column) of a 0-based YAML mark."""
        if self._starts is None:
            return mark.line + 1, mark.column + 1
        if mark.line >= len(self._starts):
            # libyaml ends a stream that lacks a final break on a line of its
            # own, past the text: as many lines past the editor's last one.
            last, _ = self.at(self._starts[-1])
            return last + mark.line - len(self._starts) + 1, mark.column + 1
        return self.at(self._starts[mark.line] + mark.column)

    def at(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset into the text."""
        before = self.text[:offset]
        return before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1

    def line_text(self, line: int) -> str:
        lines = self.text.split("\n")
        return lines[line - 1] if 0 < line <= len(lines) else ""
