"""Safe YAML loading that remembers where every value came from.

PyYAML's composed node tree carries start marks; we construct plain Python
values from it ourselves so that every dotted path maps to a line and column,
duplicate keys are reported (PyYAML silently keeps the last one), and
``${VAR}`` / ``${VAR:-default}`` are expanded in string scalars.

Hostile input is bounded while it is read, each limit reported at the place
that crosses it: the file's size, the nesting depth, the number of values the
document expands to (an alias counts the values it stands for at every use, so
a "billion laughs" stops at the limit instead of exhausting memory) and the
width of numbers.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

Path = tuple[str | int, ...]

#: Largest pipeline file read, in bytes; pipelines are a few kilobytes.
MAX_FILE_BYTES = 1024 * 1024
#: Deepest nesting of mappings and lists (libyaml's own composer recurses in C
#: and crashes the interpreter on ~30,000 levels).
MAX_DEPTH = 100
#: Most values one document may expand to, every use of an alias counted.
MAX_VALUES = 100_000
#: Longest integer or float, in characters (Python refuses ints past 4,300 digits).
MAX_NUMBER_CHARS = 100

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BOOL_TAG = "tag:yaml.org,2002:bool"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_NUMBER_TAGS = frozenset(("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"))
_SCALAR_TAGS = frozenset(
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null")
)
_PLAIN_TAGS = _SCALAR_TAGS | {_MAP_TAG, _SEQ_TAG}


# libyaml parses ~30x faster than PyYAML's pure-Python parser (5 ms instead of
# 150 ms for a 100-node file); its nodes carry the same marks.
_LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))
if TYPE_CHECKING or not _LIBYAML:  # noqa: SIM108 - mypy needs a plain class for a base
    _SafeLoader = yaml.SafeLoader
else:
    _SafeLoader = yaml.CSafeLoader
if TYPE_CHECKING:  # for mypy the base is the loader it is mixed into, which supplies events
    _ComposerBase = yaml.SafeLoader
else:
    _ComposerBase = Composer


class LimitExceeded(ComposerError):
    """Well-formed YAML past one of the loader's bounds (not a syntax error)."""


class _BoundedComposer(_ComposerBase):
    """PyYAML's composer over libyaml's events, counting depth and expanded values.

    libyaml's own composer recurses in C without a limit and hands aliases out
    as shared nodes whose expansion nobody bounds; this one stops at
    :data:`MAX_DEPTH` and :data:`MAX_VALUES` with the mark of the node or alias
    that crosses the limit.
    """

    def _start_bounds(self) -> None:
        self.anchors: dict[Any, yaml.Node] = {}
        self._depth = 0
        self._values = 0
        # Values each finished anchored node stands for; an anchor missing here
        # is still open, and an alias to it would make the document infinite.
        self._sizes: dict[int, int] = {}

    def _grow(self, count: int, mark: yaml.Mark) -> None:
        self._values += count
        if self._values > MAX_VALUES:
            raise LimitExceeded(
                None,
                None,
                f"the document expands to more than {MAX_VALUES:,} values "
                "(an alias counts every value it stands for, at each use)",
                mark,
            )

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(AliasEvent):
            event = self.get_event()
            node = self.anchors.get(event.anchor)
            if node is None:
                raise ComposerError(
                    None, None, f"found undefined alias {event.anchor!r}", event.start_mark
                )
            if id(node) not in self._sizes:
                raise LimitExceeded(
                    None,
                    None,
                    f"alias {event.anchor!r} is inside the node it refers to",
                    event.start_mark,
                )
            self._grow(self._sizes[id(node)], event.start_mark)
            return node
        event = self.peek_event()
        anchor = event.anchor
        if anchor is not None and anchor in self.anchors:
            raise ComposerError(
                f"found duplicate anchor {anchor!r}; first occurrence",
                self.anchors[anchor].start_mark,
                "second occurrence",
                event.start_mark,
            )
        before = self._values
        self._grow(1, event.start_mark)
        collection = isinstance(event, SequenceStartEvent | MappingStartEvent)
        if collection:
            if self._depth >= MAX_DEPTH:
                raise LimitExceeded(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark
                )
            self._depth += 1
        self.descend_resolver(parent, index)
        try:
            composed: yaml.Node
            if isinstance(event, ScalarEvent):
                composed = self.compose_scalar_node(anchor)
            elif isinstance(event, SequenceStartEvent):
                composed = self.compose_sequence_node(anchor)
            else:
                composed = self.compose_mapping_node(anchor)
        finally:
            self.ascend_resolver()
            if collection:
                self._depth -= 1
        if anchor is not None:
            self._sizes[id(composed)] = self._values - before
        return composed


# The composer's methods come first: libyaml's C composer would recurse without a bound.
class PipelineLoader(_BoundedComposer, _SafeLoader):
    """Safe loader with YAML 1.2 booleans: only true/false are booleans.

    YAML 1.1 also reads on/off/yes/no as booleans, so ``hma: on`` would arrive as
    ``True`` and fail as "not one of auto, on, off", while editors (YAML 1.2, the
    JSON Schema) see the string. Boolean fields still accept yes/no/on/off,
    because pydantic parses those strings.
    """

    def __init__(self, stream: str) -> None:
        _SafeLoader.__init__(self, stream)
        self._start_bounds()
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
    kind = "error" if isinstance(exc, ConstructorError | LimitExceeded) else "syntax error"
    return YAMLProblem((), f"YAML {kind}: {message}", line, col)


def _line(text: str, line: int) -> str:
    lines = text.split("\n")
    return lines[line - 1] if 0 < line <= len(lines) else ""


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


class EnvProblem(Exception):
    """A ``${VAR}`` that cannot be expanded: unset, or its value not UTF-8 text."""


def expand_env(text: str, env: Mapping[str, str]) -> str:
    """Expand ``${VAR}``, ``${VAR:-default}`` and ``$$`` in one left-to-right pass.

    A hand-written scan instead of a regular expression with a lazy default:
    that one backtracks quadratically on a long run of unclosed ``${A:-``.
    Anything that is not a complete reference stays as written.
    """
    out: list[str] = []
    pos = 0
    closed = True  # once no "}" follows, no later "${" can close either
    while True:
        dollar = text.find("$", pos)
        if dollar < 0:
            break
        out.append(text[pos:dollar])
        pos = dollar + 1
        if text.startswith("$", pos):
            out.append("$")
            pos += 1
            continue
        name = _NAME.match(text, pos + 1) if closed and text.startswith("{", pos) else None
        if name is None:
            out.append("$")
            continue
        after = name.end()
        default: str | None = None
        if text.startswith("}", after):
            end = after
        elif text.startswith(":-", after):
            end = text.find("}", after + 2)
            if end < 0:
                closed = False
                out.append("$")
                continue
            default = text[after + 2 : end]
        else:
            out.append("$")
            continue
        out.append(_lookup(name.group(), default, env))
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def _lookup(name: str, default: str | None, env: Mapping[str, str]) -> str:
    if name in env and (env[name] != "" or default is None):
        value = env[name]
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # bytes the OS kept as surrogates
            raise EnvProblem(f"environment variable ${{{name}}} is not UTF-8 text") from None
        return value
    if default is not None:
        return default
    raise EnvProblem(
        f"environment variable ${{{name}}} is not set (give a default with ${{{name}:-value}})"
    )


def _tag(node: yaml.Node) -> str:
    return str(node.tag).replace("tag:yaml.org,2002:", "!!")


class _Builder:
    def __init__(self, loader: PipelineLoader, env: Mapping[str, str]) -> None:
        self.loader = loader
        self.env = env
        self.marks = Marks()
        self.problems: list[YAMLProblem] = []

    def _problem(self, path: Path, message: str, node: yaml.Node, **kw: bool) -> None:
        self.problems.append(YAMLProblem(path, message, *_pos(node), **kw))

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.marks.values.setdefault(path, _pos(node))
        if node.tag not in _PLAIN_TAGS:
            # The safe constructors would build bytes, dates, sets or pairs, or refuse;
            # a pipeline is plain mappings, lists and JSON-like scalars.
            self._problem(path, f"unsupported YAML tag {_tag(node)}", node, replaces_value=True)
            return None
        expected = (
            MappingNode if node.tag == _MAP_TAG else SequenceNode if node.tag == _SEQ_TAG
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
            try:
                expanded = expand_env(value, self.env)
            except EnvProblem as exc:
                self._problem(path, str(exc), node, replaces_value=True)
                return value
            # Plain (unquoted) style is None in PyYAML's nodes and "" in libyaml's.
            if expanded != value and not getattr(node, "style", None):
                # An unquoted scalar becomes what YAML would have read: 8 -> int.
                value = _plain_scalar(expanded)
            else:
                value = expanded
        return value

    def _mapping(self, node: MappingNode, path: Path) -> dict[str, Any]:
        explicit, merged = self._pairs(node, path, 0)
        out: dict[str, Any] = {}
        for pairs, from_merge in ((explicit, False), (merged, True)):
            for key_node, value_node in pairs:
                key = (
                    self._scalar(key_node, path) if isinstance(key_node, ScalarNode) else None
                )
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
                self.marks.keys[(*path, key)] = _pos(key_node)
                out[key] = self.build(value_node, (*path, key))
        return out

    def _pairs(
        self, node: MappingNode, path: Path, depth: int
    ) -> tuple[list[tuple[yaml.Node, yaml.Node]], list[tuple[yaml.Node, yaml.Node]]]:
        """The mapping's own pairs, and those its ``<<`` merges bring in, in precedence order."""
        explicit: list[tuple[yaml.Node, yaml.Node]] = []
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                explicit.append((key_node, value_node))
                continue
            sources = (
                value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            )
            for source in sources:
                if not isinstance(source, MappingNode) or source.tag != _MAP_TAG:
                    self._problem(
                        path, "<< merges a mapping or a list of mappings", source
                    )
                    continue
                if depth >= MAX_DEPTH:
                    self._problem(path, f"merges nested deeper than {MAX_DEPTH} levels", source)
                    continue
                own, more = self._pairs(source, path, depth + 1)
                merged += own + more
        return explicit, merged

    def _scalar(self, node: yaml.Node, path: Path) -> Any:
        if node.tag in _NUMBER_TAGS and len(str(node.value)) > MAX_NUMBER_CHARS:
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
        except (ValueError, LookupError, TypeError, ArithmeticError):
            # The safe constructors trust the tag: !!int abc, !!bool maybe, !!float x.
            shown = str(node.value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            self._problem(
                path, f"{shown!r} is not a valid {_tag(node)}", node, replaces_value=True
            )
        return None


def _plain_scalar(text: str) -> Any:
    """What an unquoted YAML scalar with this text reads as (int, float, bool, null or str)."""
    try:
        loader = PipelineLoader(text)
    except (yaml.YAMLError, UnicodeEncodeError):
        return text
    try:
        node = loader.get_single_node()
        if (
            isinstance(node, ScalarNode)
            and node.tag in _SCALAR_TAGS
            and not (node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS)
        ):
            return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, LookupError, TypeError, ArithmeticError):
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
        except ValueError as exc:  # pure-Python PyYAML lets chr() fail on escapes past U+10FFFF
            mark = loader.get_mark()
            return None, Marks(), [
                YAMLProblem((), f"YAML syntax error: {exc}", mark.line + 1, mark.column + 1)
            ]
        if root is None:
            return None, Marks(values={(): (1, 1)}), []
        builder = _Builder(loader, os.environ if env is None else env)
        try:
            data = builder.build(root, ())
        except yaml.YAMLError as exc:
            return None, builder.marks, [syntax_problem(exc, text)]
        return data, builder.marks, builder.problems
    finally:
        loader.dispose()


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
