"""A plugin's ``self.config`` is its config class to mypy (``make lint`` checks this file).

The typo below is an error mypy must report: its ``type: ignore`` is expected, and
``warn_unused_ignores`` fails the lint the day ``self.config`` stops being typed
(an ``Any`` would make the ignore unused).
"""

from pydantic import BaseModel

from composer import Plugin


class Cfg(BaseModel):
    size: int = 1


class Node(Plugin[Cfg]):
    def ok(self) -> int:
        return self.config.size

    def typo(self) -> int:
        return self.config.sise  # type: ignore[attr-defined]
