"""``${VAR}`` and ``${VAR:-default}`` in pipeline files: expanded from the environment.

What a reference expands to is text, never YAML: the loader keeps the expanded
value a string, and typed fields convert it as pydantic does any string
(``"8000"`` for an integer, ``"true"`` for a boolean).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Characters of a broken reference a message quotes (a value may be a whole file long).
_SHOWN = 30


class EnvProblem(Exception):
    """A ``${...}`` that cannot be expanded: unterminated or malformed, its variable
    unset, or its value not UTF-8 text."""


def expand_env(text: str, env: Mapping[str, str]) -> str:
    """Expand ``${VAR}``, ``${VAR:-default}`` and ``$$`` in one left-to-right pass.

    A hand-written scan instead of a regular expression with a lazy default:
    that one backtracks quadratically on a long run of unclosed ``${A:-``.
    Every ``${`` begins a reference, so one that is not a complete
    ``${NAME}`` or ``${NAME:-default}`` raises :class:`EnvProblem` rather than
    staying in the value as text the user did not mean; the first such one
    ends the scan, which keeps it linear. A ``$`` not followed by ``{`` is text.
    """
    out: list[str] = []
    pos = 0
    while (dollar := text.find("$", pos)) >= 0:
        out.append(text[pos:dollar])
        pos = dollar + 1
        if text.startswith("$", pos):
            out.append("$")
            pos += 1
            continue
        if not text.startswith("{", pos):
            out.append("$")
            continue
        end = text.find("}", pos)
        if end < 0:
            raise EnvProblem(
                f'unterminated reference "{_shown(text[dollar:])}": no "}}" closes it '
                "(write $$ for a literal $)"
            )
        name, colon_dash, default = text[pos + 1 : end].partition(":-")
        if not _NAME.fullmatch(name):
            raise EnvProblem(
                f'"{_shown(text[dollar : end + 1])}" is not ${{NAME}} or ${{NAME:-default}} '
                "(a NAME is letters, digits and _, not starting with a digit; write $$ for a "
                "literal $)"
            )
        if "${" in default:
            # The default ends at the first "}", so a nested reference would be cut in two.
            raise EnvProblem(
                f'"{_shown(text[dollar : end + 1])}": a default cannot hold another ${{...}}'
            )
        out.append(_lookup(name, default if colon_dash else None, env))
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def _shown(fragment: str) -> str:
    return fragment if len(fragment) <= _SHOWN else fragment[: _SHOWN - 3] + "..."


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
