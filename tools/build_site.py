"""Build the documentation site, static HTML for reading offline (`make site`).

The home page is the README, then the course (tutorials/README.md and every lesson, in order)
and the guides in docs/. Each lesson page shows the outputs of its run by
tools/render_tutorials.py (the one `make tutorials` does: a fresh kernel, BokehJS inline) and how
long that run took. A lesson whose executed copy in build/tutorials/ is missing, failed, or was
made from another version of the notebook or before viz/lessons.py last changed is executed
first, once; the others are reused.

Sphinx (myst-nb, sphinx-book-theme; configuration in tools/site/conf.py) reads a staging copy laid
out like the repository, build/site-src/, and writes build/site/. Any Sphinx warning (a link to a
page or anchor that does not exist, say) fails the build.

    python tools/build_site.py [--only 00 03] [--out build/site]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import nbformat
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "tools" / "site"
EXECUTED = ROOT / "build" / "tutorials"
STAGE = ROOT / "build" / "site-src"
BOKEH_JUPYTER_MIME = "application/vnd.bokehjs_"
# The lessons' outputs are drawn by this module too (`beside`'s layout, excerpts): a copy executed
# before it last changed shows the old HTML, however unchanged its notebook.
HELPERS = ROOT / "viz" / "lessons.py"
# The guides in reading order; a page in docs/ missing here comes after these, by name.
DOC_ORDER = [
    "request-path",
    "architecture",
    "tracing",
    "dashboard",
    "scaling",
    "benchmarks",
    "gpu-check",
]


# Run as `python tools/build_site.py`, whose folder Python puts on the path: the checkout too.
sys.path.insert(0, str(ROOT))
from tools import render_tutorials as renderer  # noqa: E402


def why_execute(source: Path, executed: Path) -> str | None:
    """Why the executed copy of `source` cannot be reused, or None when it can."""
    if not executed.exists():
        return "not executed yet"
    run = nbformat.read(executed, as_version=4).metadata.get("stepscope", {})
    if run.get("source_sha256") != renderer.source_digest(source):
        return "the notebook changed since"
    if run.get("error"):
        return "its last run failed"
    if HELPERS.stat().st_mtime > datetime.fromisoformat(run["executed_at"]).timestamp():
        return f"{HELPERS.relative_to(ROOT)} changed since"
    return None


def executed_lessons(only: list[str] | None, timeout: int) -> tuple[list[Path], list[str]]:
    """The executed copy of each lesson, running those that need it: (copies, failed names)."""
    sources = renderer.notebooks(only)
    todo = []
    for source in sources:
        reason = why_execute(source, EXECUTED / source.name)
        if reason is None:
            print(f"{source.name}: reusing {EXECUTED / source.name}", flush=True)
        else:
            print(f"{source.name}: executing ({reason})", flush=True)
            todo.append(source)
    failed = renderer.render_all(todo, EXECUTED, timeout) if todo else []
    return [EXECUTED / source.name for source in sources], failed


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def lesson_page(executed: Path) -> NotebookNode:
    """The executed lesson with one line under its title: how long its run took, where, when."""
    notebook = nbformat.read(executed, as_version=4)
    run = notebook.metadata.get("stepscope", {})
    day = datetime.fromisoformat(run["executed_at"]).strftime("%Y-%m-%d")
    note = (
        f"*Executed in {_duration(run['wall_s'])} on {run['machine']}, {day}: top to bottom, "
        "in a fresh kernel, by `make tutorials`; these are that run's outputs.*"
    )
    if run.get("error"):
        note += f"\n\n:::{{warning}}\nThis run failed: `{run['error']}`\n:::"
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            # Bokeh's Jupyter-only payloads (for the kernel's comms); the application/javascript
            # beside each is what loads BokehJS and draws the figure on a static page.
            for mime in [m for m in output.get("data", {}) if m.startswith(BOKEH_JUPYTER_MIME)]:
                del output["data"][mime]
    first = notebook.cells[0]
    lines = first.source.splitlines()
    title = next((i for i, line in enumerate(lines) if line.startswith("# ")), -1)
    lines[title + 1 : title + 1] = ["", note, ""]
    first.source = "\n".join(lines)
    return notebook


def _toctree(caption: str, docnames: list[str]) -> str:
    return "\n".join(
        ["", "```{toctree}", ":hidden:", f":caption: {caption}", "", *docnames, "```", ""]
    )


def stage(lessons: list[Path]) -> None:
    """Lay out build/site-src/ like the repository, with the README as index.md."""
    shutil.rmtree(STAGE, ignore_errors=True)
    shutil.copytree(ROOT / "docs", STAGE / "docs", ignore=shutil.ignore_patterns("*.py", "_*"))
    docs = sorted(p.stem for p in (STAGE / "docs").glob("*.md"))
    docs = [d for d in DOC_ORDER if d in docs] + [d for d in docs if d not in DOC_ORDER]
    (STAGE / "tutorials").mkdir()
    shutil.copy(ROOT / "tutorials" / "README.md", STAGE / "tutorials" / "README.md")
    for executed in lessons:
        nbformat.write(lesson_page(executed), STAGE / "tutorials" / executed.name)
    index = (ROOT / "README.md").read_text(encoding="utf-8")
    index += _toctree("Course", ["tutorials/README", *[f"tutorials/{p.stem}" for p in lessons]])
    index += _toctree("Guides", [f"docs/{d}" for d in docs])
    (STAGE / "index.md").write_text(index, encoding="utf-8")


def build(out: Path) -> int:
    """Sphinx, from scratch (a stale page from an earlier build must not survive)."""
    shutil.rmtree(out, ignore_errors=True)
    doctrees = STAGE.parent / "site-doctrees"
    shutil.rmtree(doctrees, ignore_errors=True)
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going"]
    command += ["-c", str(CONF_DIR), "-d", str(doctrees), str(STAGE), str(out)]
    return subprocess.run(command, cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="PREFIX", help="just these lessons")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "site")
    parser.add_argument("--timeout", type=int, default=renderer.CELL_TIMEOUT_S, help="per cell")
    args = parser.parse_args(argv)

    lessons, failed = executed_lessons(args.only, args.timeout)
    if not lessons:
        print(f"no tutorial matches {args.only}", file=sys.stderr)
        return 2
    stage(lessons)
    status = build(args.out)
    print(f"site: {args.out / 'index.html'}" if status == 0 else "sphinx-build failed", flush=True)
    if failed:
        print(
            f"{len(failed)} lessons failed; their pages show the error: {', '.join(failed)}",
            file=sys.stderr,
        )
    return 1 if status or failed else 0


if __name__ == "__main__":
    sys.exit(main())
