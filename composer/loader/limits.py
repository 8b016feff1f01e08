"""PyYAML composing within bounds: depth, values (aliases counted at every use), numbers.

Hostile input is bounded while it is read, each limit reported at the place
that crosses it, so a "billion laughs" stops at the limit instead of
exhausting memory. :class:`PipelineLoader` is the safe loader every pipeline
file goes through (YAML 1.2 booleans, no timestamps).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer, ComposerError
from yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent

#: Deepest nesting of mappings and lists (libyaml's own composer recurses in C
#: and crashes the interpreter on ~30,000 levels).
MAX_DEPTH = 100
#: Most values one document may expand to, every use of an alias counted.
MAX_VALUES = 100_000
#: Longest integer or float, in characters (Python refuses ints past 4,300 digits).
MAX_NUMBER_CHARS = 100

BOOL_TAG = "tag:yaml.org,2002:bool"
TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
MERGE_TAG = "tag:yaml.org,2002:merge"
MAP_TAG = "tag:yaml.org,2002:map"
SEQ_TAG = "tag:yaml.org,2002:seq"
NUMBER_TAGS = frozenset(("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"))
SCALAR_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null"))
PLAIN_TAGS = SCALAR_TAGS | {MAP_TAG, SEQ_TAG}


# libyaml parses ~30x faster than PyYAML's pure-Python parser (5 ms instead of
# 150 ms for a 100-node file); its nodes carry the same marks.
LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))
if TYPE_CHECKING or not LIBYAML:  # noqa: SIM108 - mypy needs a plain class for a base
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


class PurePipelineLoader(_BoundedComposer, yaml.SafeLoader):
    """:class:`PipelineLoader` on PyYAML's pure-Python parser.

    libyaml (in PyYAML >= 6.0.4 wheels) stops at its own nesting limit while it
    scans ahead, before the composer reaches :data:`MAX_DEPTH`: this parser
    gives the same events, so the bound reports its own message and place.
    """

    def __init__(self, stream: str) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._start_bounds()


#: Either loader: the same composer and resolvers over another parser.
AnyPipelineLoader = PipelineLoader | PurePipelineLoader


def libyaml_too_deep(exc: yaml.YAMLError) -> bool:
    """Whether ``exc`` is libyaml's own nesting limit (see :class:`PurePipelineLoader`)."""
    return LIBYAML and "maximum nesting depth" in str(exc)


# Timestamps go too: YAML 1.2 has none, and a date where a string is expected
# (an engine id, a path) would fail as "not a string".
PipelineLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (BOOL_TAG, TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
PipelineLoader.add_implicit_resolver(
    BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
PurePipelineLoader.yaml_implicit_resolvers = PipelineLoader.yaml_implicit_resolvers
