"""The README and the pages under ``docs/``: every link resolves (a file of the
repository, a heading of a page), every page is in the site's table of contents.
``make lint`` also builds the site with Sphinx, warnings as errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without its code blocks (a link there is code, not a link)."""
    return re.sub(r"^```.*?^```[^\n]*\n", "", text, flags=re.MULTILINE | re.DOTALL)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading (Sphinx's, with ``myst_heading_anchors``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {
        _anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.*)$", _prose(page.read_text()), re.M)
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for label, target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue  # outside the repository: not checked here (no network)
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"[{label}]({target}): no {path}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"[{label}]({target}): no heading #{anchor} in {file.name}")
    assert broken == []


def test_every_page_is_in_the_table_of_contents() -> None:
    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"^([\w-]+)$", index, re.M))
    assert listed == {p.stem for p in DOCS.glob("*.md")} - {"index"}


def test_the_readme_says_where_each_page_is() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = [p.name for p in DOCS.glob("*.md") if p.stem != "index"]
    missing = [name for name in pages if f"docs/{name}" not in readme]
    assert missing == []
