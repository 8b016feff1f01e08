"""Sphinx configuration: the pages are Markdown (MyST), checked by ``make lint``
(``sphinx-build -W``: a broken link between pages, or to a heading, fails it)."""

project = "KV Composer"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# GitHub's heading anchors, so that links work on GitHub and in the built site alike.
myst_heading_anchors = 4
html_theme = "furo"
html_title = "KV Composer"

from pathlib import Path  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent


def _repository_file(app, env, node, contnode):  # type: ignore[no-untyped-def]
    """A link from a page to a file of the repository (``../examples/x.yaml``): a
    link on GitHub, plain text in the built site. A path that does not exist is
    still a broken link."""
    target = node.get("reftarget", "")
    if target.startswith("../") and (REPOSITORY / target[3:]).exists():
        return contnode
    return None


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _repository_file)
