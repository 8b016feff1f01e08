"""``${VAR}`` and ``${VAR:-default}`` in pipeline files: expanded from the environment."""

from __future__ import annotations

import re
from collections.abc import Mapping

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
