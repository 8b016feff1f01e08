"""Safe YAML loading that remembers where every value came from.

PyYAML's composed node tree carries start marks; we construct plain Python
values from it ourselves so that every dotted path maps to a line and column,
duplicate keys are reported (PyYAML silently keeps the last one), and
``${VAR}`` / ``${VAR:-default}`` are expanded in string scalars.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

Path = tuple[str | int, ...]
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}|\$\$")
_BOOL_TAG = "tag:yaml.org,2002:bool"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "str", "int", "float", "bool", "null")
)


# libyaml parses ~30x faster than PyYAML's pure-Python parser (5 ms instead of
# 150 ms for a 100-node file); its nodes carry the same marks.
_LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))
if TYPE_CHECKING or not _LIBYAML:  # noqa: SIM108 - mypy needs a plain class for a base
    _SafeLoader = yaml.SafeLoader
else:
    _SafeLoader = yaml.CSafeLoader


class PipelineLoader(_SafeLoader):
    """Safe loader with YAML 1.2 booleans: only true/false are booleans.

    YAML 1.1 also reads on/off/yes/no as booleans, so ``hma: on`` would arrive as
    ``True`` and fail as "not one of auto, on, off", while editors (YAML 1.2, the
    JSON Schema) see the string. Boolean fields still accept yes/no/on/off,
    because pydantic parses those strings.
    """


# Timestamps go too: YAML 1.2 has none, and a date where a string is expected
# (an engine id, a path) would fail as "not a string".
PipelineLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
PipelineLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


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


class YAMLProblem(Exception):
    """A problem found while reading YAML.

    ``replaces_value`` means the value at ``path`` is not what the user meant
    (an unset variable, an unsupported tag): later checks of that value would
    only repeat the problem, so validation drops them.
    """

    def __init__(
        self,
        path: Path,
        message: str,
        line: int | None,
        column: int | None,
        *,
        replaces_value: bool = False,
    ) -> None:
        super().__init__(message)
        self.path, self.message, self.line, self.column = path, message, line, column
        self.replaces_value = replaces_value


def syntax_problem(exc: yaml.YAMLError, text: str = "") -> YAMLProblem:
    """One located problem from PyYAML's error, without its multi-line rendering."""
    if isinstance(exc, yaml.reader.ReaderError):
        # libyaml counts bytes of UTF-8, PyYAML characters.
        position = (
            len(text.encode("utf-8")[: exc.position].decode("utf-8", errors="ignore"))
            if _LIBYAML
            else exc.position
        )
        before = text[:position]
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        return YAMLProblem(
            (),
            f"YAML syntax error: character {char!r} (#x{ord(char):04x}) is not allowed",
            before.count("\n") + 1,
            position - (before.rfind("\n") + 1) + 1,
        )
    if not isinstance(exc, yaml.MarkedYAMLError):
        return YAMLProblem((), f"YAML error: {exc}", None, None)
    mark = exc.problem_mark or exc.context_mark
    line: int | None = mark.line + 1 if mark else None
    col: int | None = mark.column + 1 if mark else None
    message = str(exc.problem or exc.context or "invalid YAML")
    if exc.context and exc.problem:
        where = ""
        if exc.context_mark is not None and mark is not None and (
            (exc.context_mark.line, exc.context_mark.column) != (mark.line, mark.column)
        ):
            where = f" at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
        message += f" ({exc.context}{where})"
    if line is not None and col is not None and _line(text, line)[col - 1 : col] == "\t":
        message += "; indent with spaces, YAML does not allow tabs"
    elif line is not None and "flow" in str(exc.context) and "${" in _line(text, line):
        message += "; quote ${...} values inside {...} and [...]"
    kind = "error" if isinstance(exc, yaml.constructor.ConstructorError) else "syntax error"
    return YAMLProblem((), f"YAML {kind}: {message}", line, col)


def _line(text: str, line: int) -> str:
    lines = text.split("\n")
    return lines[line - 1] if 0 < line <= len(lines) else ""


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def expand_env(text: str, env: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        if name in env and (env[name] != "" or default is None):
            return env[name]
        if default is not None:
            return default
        raise KeyError(name)

    return _ENV.sub(sub, text)


class _Builder:
    def __init__(self, loader: yaml.SafeLoader, env: Mapping[str, str]) -> None:
        self.loader = loader
        self.env = env
        self.marks = Marks()
        self.problems: list[YAMLProblem] = []

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.marks.values.setdefault(path, _pos(node))
        if node.tag not in _PLAIN_TAGS:
            # The safe constructors would build bytes, dates, sets or pairs, or refuse;
            # a pipeline is plain mappings, lists and JSON-like scalars.
            self.problems.append(
                YAMLProblem(
                    path,
                    f"unsupported YAML tag {node.tag.replace('tag:yaml.org,2002:', '!!')}",
                    *_pos(node),
                    replaces_value=True,
                )
            )
            return None
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)  # resolves "<<" merge keys
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = (
                    self._scalar(key_node, path)
                    if isinstance(key_node, yaml.ScalarNode)
                    else None
                )
                if not isinstance(key, str | int | float | bool):
                    self.problems.append(
                        YAMLProblem(path, "mapping keys must be plain scalars", *_pos(key_node))
                    )
                    continue
                key = str(key) if not isinstance(key, str) else key
                if key in out:
                    first = self.marks.keys.get((*path, key), (None, None))
                    self.problems.append(
                        YAMLProblem(
                            (*path, key),
                            f'duplicate key "{key}" (first defined at line {first[0]})',
                            *_pos(key_node),
                        )
                    )
                    continue
                self.marks.keys[(*path, key)] = _pos(key_node)
                out[key] = self.build(value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        value = self._scalar(node, path)
        if isinstance(value, str) and "$" in value:
            try:
                expanded = expand_env(value, self.env)
            except KeyError as missing:
                self.problems.append(
                    YAMLProblem(
                        path,
                        f"environment variable ${{{missing.args[0]}}} is not set "
                        f"(give a default with ${{{missing.args[0]}:-value}})",
                        *_pos(node),
                        replaces_value=True,
                    )
                )
                return value
            # Plain (unquoted) style is None in PyYAML's nodes and "" in libyaml's.
            if expanded != value and not getattr(node, "style", None):
                # An unquoted scalar becomes what YAML would have read: 8 -> int.
                value = _plain_scalar(expanded)
            else:
                value = expanded
        return value

    def _scalar(self, node: yaml.Node, path: Path) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as exc:  # e.g. an unknown or bad tag
            problem = syntax_problem(exc)
            self.problems.append(
                YAMLProblem(
                    path,
                    problem.message.removeprefix("YAML error: "),
                    problem.line,
                    problem.column,
                    replaces_value=True,
                )
            )
            return None


def _plain_scalar(text: str) -> Any:
    """What an unquoted YAML scalar with this text reads as (int, float, bool, null or str)."""
    loader = PipelineLoader(text)
    try:
        node = loader.get_single_node()
        if isinstance(node, yaml.ScalarNode):
            return loader.construct_object(node, deep=True)
    except yaml.YAMLError:
        pass
    finally:
        loader.dispose()
    return text


def load_yaml(
    text: str, *, env: Mapping[str, str] | None = None
) -> tuple[Any, Marks, list[YAMLProblem]]:
    """Parse one YAML document safely; returns (data, marks, problems)."""
    try:
        loader = PipelineLoader(text)
    except yaml.YAMLError as exc:  # the reader checks every character up front
        return None, Marks(), [syntax_problem(exc, text)]
    except UnicodeEncodeError as exc:  # lone surrogates, e.g. undecodable bytes kept as such
        before = text[: exc.start]
        line, col = before.count("\n") + 1, exc.start - (before.rfind("\n") + 1) + 1
        return None, Marks(), [YAMLProblem((), "the text is not valid Unicode", line, col)]
    try:
        try:
            root = loader.get_single_node()
        except yaml.YAMLError as exc:
            return None, Marks(), [syntax_problem(exc, text)]
        except RecursionError:  # PyYAML's composer recurses once per nesting level
            return None, Marks(), [YAMLProblem((), "YAML nesting is too deep", None, None)]
        except ValueError as exc:  # pure-Python PyYAML lets chr() fail on escapes past U+10FFFF
            mark = loader.get_mark()
            return None, Marks(), [
                YAMLProblem((), f"YAML syntax error: {exc}", mark.line + 1, mark.column + 1)
            ]
        if root is None:
            return None, Marks(), []
        builder = _Builder(loader, os.environ if env is None else env)
        try:
            data = builder.build(root, ())
        except yaml.YAMLError as exc:
            return None, builder.marks, [syntax_problem(exc, text)]
        except RecursionError:
            return None, builder.marks, [YAMLProblem((), "YAML nesting is too deep", None, None)]
        return data, builder.marks, builder.problems
    finally:
        loader.dispose()
