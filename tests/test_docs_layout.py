"""docs/development.md's "Where the runtime lives" names every module and folder of
``composer/``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _layout_section() -> str:
    page = (ROOT / "docs" / "development.md").read_text()
    start = page.index("## Where the runtime lives")
    return page[start : page.index("\n## ", start + 1)]


def test_every_module_and_folder_of_composer_is_named() -> None:
    named = set(re.findall(r"`([\w.]+)/?`", _layout_section()))
    package = ROOT / "composer"
    parts = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    parts |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    for folder in (p for p in package.iterdir() if (p / "__init__.py").exists()):
        parts |= {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert sorted(parts - named) == []
