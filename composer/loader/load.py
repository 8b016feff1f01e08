"""Safe YAML loading that remembers where every value came from (:func:`load_yaml`).

PyYAML's composed node tree carries start marks; we construct plain Python
values from it ourselves so that every dotted path maps to a line and column
(:mod:`.positions`), duplicate keys are reported (PyYAML silently keeps the last
one), and ``${VAR}`` / ``${VAR:-default}`` are expanded in string scalars, into
strings (:mod:`.env_vars`). Hostile input is bounded while it is read
(:mod:`.limits`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from composer.loader.env_vars import EnvProblem, expand_env
from composer.loader.file import FileProblem, read_pipeline_file
from composer.loader.limits import (
    LIBYAML,
    MAP_TAG,
    MAX_DEPTH,
    MAX_NUMBER_CHARS,
    MERGE_TAG,
    NUMBER_TAGS,
    PLAIN_TAGS,
    SEQ_TAG,
    AnyPipelineLoader,
    LimitExceeded,
    PipelineLoader,
    PurePipelineLoader,
    libyaml_too_deep,
)
from composer.loader.positions import Marks, Path, Positions


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


def syntax_problem(exc: yaml.YAMLError, positions: Positions) -> YAMLProblem:
    """One located problem from PyYAML's error, without its multi-line rendering."""
    if isinstance(exc, yaml.reader.ReaderError):
        # libyaml counts bytes of UTF-8, PyYAML characters.
        text = positions.text
        offset = (
            len(text.encode("utf-8")[: exc.position].decode("utf-8", errors="ignore"))
            if LIBYAML
            else exc.position
        )
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        return YAMLProblem(
            (),
            f"YAML syntax error: character {char!r} (#x{ord(char):04x}) is not allowed",
            *positions.at(offset),
        )
    if not isinstance(exc, yaml.MarkedYAMLError):
        return YAMLProblem((), f"YAML error: {exc}", None, None)
    mark = exc.problem_mark or exc.context_mark
    line, col = positions.of(mark) if mark else (None, None)
    message = str(exc.problem or exc.context or "invalid YAML")
    if exc.context and exc.problem:
        where = ""
        if exc.context_mark is not None and mark is not None:
            context_line, context_col = positions.of(exc.context_mark)
            if (context_line, context_col) != (line, col):
                where = f" at line {context_line}, column {context_col}"
        message += f" ({exc.context}{where})"
    if line is not None and col is not None:
        text_of_line = positions.line_text(line)
        if text_of_line[col - 1 : col] == "\t":
            message += "; indent with spaces, YAML does not allow tabs"
        elif "flow" in str(exc.context) and "${" in text_of_line:
            message += "; quote ${...} values inside {...} and [...]"
    kind = "error" if isinstance(exc, ConstructorError | LimitExceeded) else "syntax error"
    return YAMLProblem((), f"YAML {kind}: {message}", line, col)


def _tag(node: yaml.Node) -> str:
    return str(node.tag).replace("tag:yaml.org,2002:", "!!")


class _Builder:
    def __init__(
        self, loader: AnyPipelineLoader, env: Mapping[str, str], positions: Positions
    ) -> None:
        self.loader = loader
        self.positions = positions
        self.env = env
        self.marks = Marks()
        self.problems: list[YAMLProblem] = []

    def _problem(self, path: Path, message: str, node: yaml.Node, **kw: bool) -> None:
        self.problems.append(YAMLProblem(path, message, *self.positions.of(node.start_mark), **kw))

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.marks.values.setdefault(path, self.positions.of(node.start_mark))
        if node.tag not in PLAIN_TAGS:
            # The safe constructors would build bytes, dates, sets or pairs, or refuse;
            # a pipeline is plain mappings, lists and JSON-like scalars.
            self._problem(path, f"unsupported YAML tag {_tag(node)}", node, replaces_value=True)
            return None
        expected = (
            MappingNode
            if node.tag == MAP_TAG
            else SequenceNode
            if node.tag == SEQ_TAG
            else ScalarNode
        )
        if not isinstance(node, expected):
            self._problem(
                path, f"YAML tag {_tag(node)} does not fit this value", node, replaces_value=True
            )
            return None
        if isinstance(node, MappingNode):
            return self._mapping(node, path)
        if isinstance(node, SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        value = self._scalar(node, path)
        if isinstance(value, str) and "$" in value:
            # Text, whatever it looks like and however the value is quoted: YAML
            # reads the file, not the environment (no tags, lists or numbers arrive
            # through a variable). Typed fields convert it as pydantic converts text.
            try:
                return expand_env(value, self.env)
            except EnvProblem as exc:
                self._problem(path, str(exc), node, replaces_value=True)
        return value

    def _mapping(self, node: MappingNode, path: Path) -> dict[str, Any]:
        explicit, merged = self._pairs(node, path, 0)
        out: dict[str, Any] = {}
        for pairs, from_merge in ((explicit, False), (merged, True)):
            for key_node, value_node in pairs:
                key = self._scalar(key_node, path) if isinstance(key_node, ScalarNode) else None
                if not isinstance(key, str | int | float | bool):
                    self._problem(path, "mapping keys must be plain scalars", key_node)
                    continue
                key = str(key) if not isinstance(key, str) else key
                if key in out:
                    # A merged key never overrides: the mapping's own keys and earlier
                    # merges take precedence (YAML's merge rule), so it is no duplicate.
                    if not from_merge:
                        first = self.marks.keys.get((*path, key), (None, None))
                        self._problem(
                            (*path, key),
                            f'duplicate key "{key}" (first defined at line {first[0]})',
                            key_node,
                        )
                    continue
                self.marks.keys[(*path, key)] = self.positions.of(key_node.start_mark)
                out[key] = self.build(value_node, (*path, key))
        return out

    def _pairs(
        self, node: MappingNode, path: Path, depth: int
    ) -> tuple[list[tuple[yaml.Node, yaml.Node]], list[tuple[yaml.Node, yaml.Node]]]:
        """The mapping's own pairs, and those its ``<<`` merges bring in, in precedence order."""
        explicit: list[tuple[yaml.Node, yaml.Node]] = []
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != MERGE_TAG:
                explicit.append((key_node, value_node))
                continue
            sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, MappingNode) or source.tag != MAP_TAG:
                    self._problem(path, "<< merges a mapping or a list of mappings", source)
                    continue
                if depth >= MAX_DEPTH:
                    self._problem(path, f"merges nested deeper than {MAX_DEPTH} levels", source)
                    continue
                own, more = self._pairs(source, path, depth + 1)
                merged += own + more
        return explicit, merged

    def _scalar(self, node: yaml.Node, path: Path) -> Any:
        if node.tag in NUMBER_TAGS and len(str(node.value)) > MAX_NUMBER_CHARS:
            self._problem(
                path,
                f"number with {len(node.value):,} characters; at most {MAX_NUMBER_CHARS} "
                "are read (quote it if it is text)",
                node,
                replaces_value=True,
            )
            return None
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as exc:  # e.g. an unknown or bad tag
            problem = syntax_problem(exc, self.positions)
            self.problems.append(
                YAMLProblem(
                    path,
                    problem.message.removeprefix("YAML error: "),
                    problem.line,
                    problem.column,
                    replaces_value=True,
                )
            )
        except (ValueError, LookupError, TypeError, ArithmeticError):
            # The safe constructors trust the tag: !!int abc, !!bool maybe, !!float x.
            shown = str(node.value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            self._problem(path, f"{shown!r} is not a valid {_tag(node)}", node, replaces_value=True)
        return None


def load_yaml(
    text: str, *, env: Mapping[str, str] | None = None
) -> tuple[Any, Marks, list[YAMLProblem]]:
    """Parse one YAML document safely; returns (data, marks, problems)."""
    positions = Positions(text)
    try:
        loader: AnyPipelineLoader = PipelineLoader(text)
    except yaml.YAMLError as exc:  # the reader checks every character up front
        return None, Marks(), [syntax_problem(exc, positions)]
    except UnicodeEncodeError as exc:  # lone surrogates, e.g. undecodable bytes kept as such
        return (
            None,
            Marks(),
            [YAMLProblem((), "the text is not valid Unicode", *positions.at(exc.start))],
        )
    try:
        try:
            try:
                root = loader.get_single_node()
            except yaml.YAMLError as exc:
                if not libyaml_too_deep(exc):
                    raise
                loader.dispose()
                loader = PurePipelineLoader(text)
                root = loader.get_single_node()
        except yaml.YAMLError as exc:
            return None, Marks(), [syntax_problem(exc, positions)]
        except ValueError as exc:  # pure-Python PyYAML lets chr() fail on escapes past U+10FFFF
            where = positions.of(loader.get_mark())
            return None, Marks(), [YAMLProblem((), f"YAML syntax error: {exc}", *where)]
        if root is None:
            return None, Marks(values={(): (1, 1)}), []
        builder = _Builder(loader, os.environ if env is None else env, positions)
        try:
            data = builder.build(root, ())
        except yaml.YAMLError as exc:
            return None, builder.marks, [syntax_problem(exc, positions)]
        return data, builder.marks, builder.problems
    finally:
        loader.dispose()


def file_marks(path: str) -> Marks | None:
    """The YAML marks of a pipeline file read a moment ago, to locate problems found later
    (a model check, a refusal of sleep mode); None for stdin (``-``) or a file replaced
    since."""
    if path == "-":
        return None
    try:
        _, marks, _ = load_yaml(read_pipeline_file(path))
    except FileProblem:
        return None
    return marks
