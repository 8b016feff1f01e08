"""The types of conftest's pipeline checkers, for the tests that take them.

``problems(yaml_text, env=...)`` returns the str() of every problem (asserting
there are some); ``valid(yaml_text, env=...)`` returns the resolved pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

from composer import ResolvedPipeline

Check = Callable[..., list[str]]
Valid = Callable[..., ResolvedPipeline]
