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
from typing import Any

import yaml

Path = tuple[str | int, ...]
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}|\$\$")


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
    def __init__(self, path: Path, message: str, line: int | None, column: int | None) -> None:
        super().__init__(message)
        self.path, self.message, self.line, self.column = path, message, line, column


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
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)  # resolves "<<" merge keys
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.loader.construct_object(key_node, deep=True)
                if not isinstance(key, str | int | float | bool) or key is None:
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
        value = self.loader.construct_object(node, deep=True)
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
                    )
                )
                return value
            if expanded != value and node.style is None:
                # An unquoted scalar becomes what YAML would have read: 8 -> int.
                value = yaml.safe_load(expanded) if expanded.strip() else expanded
                if isinstance(value, dict | list):
                    value = expanded
            else:
                value = expanded
        return value


def load_yaml(
    text: str, *, env: Mapping[str, str] | None = None
) -> tuple[Any, Marks, list[YAMLProblem]]:
    """Parse one YAML document safely; returns (data, marks, problems)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
            msg = " ".join(str(p) for p in (exc.context, exc.problem) if p) or str(exc)
            return None, Marks(), [YAMLProblem((), f"YAML syntax error: {msg}", line, col)]
        except yaml.YAMLError as exc:
            return None, Marks(), [YAMLProblem((), f"YAML error: {exc}", None, None)]
        if root is None:
            return None, Marks(), []
        builder = _Builder(loader, os.environ if env is None else env)
        try:
            data = builder.build(root, ())
        except yaml.YAMLError as exc:  # e.g. a bad tag on a scalar
            mark = getattr(exc, "problem_mark", None)
            line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
            return None, builder.marks, [YAMLProblem((), f"YAML error: {exc}", line, col)]
        except RecursionError:
            return None, builder.marks, [YAMLProblem((), "YAML nesting is too deep", None, None)]
        return data, builder.marks, builder.problems
    finally:
        loader.dispose()
