"""Sphinx configuration of the documentation site (`make site`; tools/build_site.py).

The source folder is a staging copy that tools/build_site.py lays out like the repository: the
README as index.md, docs/, tutorials/README.md and the executed lessons in tutorials/. So a link
that works on the repository (`../docs/tracing.md`, `../tutorials/03_choosing_a_batch.ipynb`)
works here unchanged. A link to a file that is not a page (a source file such as
`engine/core/scheduler.py`) becomes its text and the file's path in the repository: the site has
no copy of the source to link to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform

ROOT = Path(__file__).resolve().parents[2]

project = "stepscope"
author = "stepscope"
root_doc = "index"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# The lessons were executed once, by tools/render_tutorials.py, in a fresh kernel each; the site
# shows those outputs and never runs a notebook.
nb_execution_mode = "off"
# Loaded from a CDN when a notebook holds ipywidgets state; none does, and the site is offline.
nb_ipywidgets_js: dict[str, dict[str, str]] = {}
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
# The docs are written for GitHub, where a page may start at any heading level.
suppress_warnings = ["myst.header"]

html_theme = "sphinx_book_theme"
html_title = "stepscope"
html_favicon = "favicon.svg"  # without one the browser asks for /favicon.ico, and gets a 404
# The theme's light/dark switch starts here; light suits the Bokeh figures, drawn on white.
html_context = {"default_mode": "light"}
html_theme_options = {
    "show_toc_level": 2,
    "navbar_persistent": [],
    "navigation_with_keys": False,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_show_sphinx = False
html_copy_source = False


def _repo_path(docname: str, target: str) -> Path | None:
    """The repository file or folder a link in `docname` points to, if the link is a local one."""
    path = target.split("#", 1)[0]
    if not path or "://" in path or path.startswith(("mailto:", "/")):
        return None
    resolved = (ROOT / docname).parent.joinpath(path).resolve()
    if docname == "index":  # index.md is the README, which lives at the root too
        resolved = ROOT.joinpath(path).resolve()
    if not resolved.is_relative_to(ROOT) or not resolved.exists():
        return None
    return resolved


class RepositoryLinks(SphinxPostTransform):
    """Runs before MyST resolves its links: a link to the README becomes a link to the home page,
    and a link to any other repository file that is not a page becomes plain text."""

    default_priority = 8  # MystReferenceResolver is 9

    def run(self, **kwargs: Any) -> None:
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst" or node.get("refdomain") is not None:
                continue
            target = node["reftarget"]
            path = _repo_path(node.get("refdoc", self.env.docname), target)
            if path is None:
                continue
            if path == ROOT / "README.md":
                node["refdomain"] = "doc"
                node["reftarget"] = "index"
                node["reftargetid"] = target.partition("#")[2] or None
                continue
            node.replace_self(self._as_text(node, path.relative_to(ROOT).as_posix()))

    @staticmethod
    def _as_text(node: addnodes.pending_xref, repo_path: str) -> nodes.inline:
        text = node.astext()
        shown = nodes.inline("", "", *[child.deepcopy() for child in node.children])
        if repo_path.rstrip("/") not in text:
            shown += [nodes.Text(" ("), nodes.literal(repo_path, repo_path), nodes.Text(")")]
        shown["classes"].append("repo-path")
        return shown


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_post_transform(RepositoryLinks)
    return {"parallel_read_safe": True}
