"""The JupyterLab tutorials (tutorials/): a quickstart and ten lessons on vLLM V1's request path.

Each notebook is committed without outputs, has the parts of a lesson (a question first, a
prediction, the code that decides the answer, the vLLM source it mirrors, a figure, exercises, a
summary of what was measured, a pointer to docs/request-path.md), and runs top to bottom on the
real engine, asserting the figures it measures, so a wrong engine fails here. Every notebook runs
in a fresh kernel of this interpreter, in a temporary working directory, through the same function
`make tutorials` uses (tools/render_tutorials.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode

from tools import render_tutorials

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
LESSONS = [f"{i:02d}" for i in range(11)]  # the quickstart, then ten lessons


RENDERER = render_tutorials
NOTEBOOKS = RENDERER.notebooks()
CELL_TIMEOUT_S = RENDERER.CELL_TIMEOUT_S


def _ids(path: Path) -> str:
    return path.stem


def _cells(notebook: NotebookNode, kind: str | None = None) -> list[str]:
    return [c.source for c in notebook.cells if kind is None or c.cell_type == kind]


def _heading(notebook: NotebookNode, words: str) -> bool:
    pattern = re.compile(rf"^#+ .*{re.escape(words)}", re.MULTILINE | re.IGNORECASE)
    return any(pattern.search(s) for s in _cells(notebook, "markdown"))


# What every lesson has, each as (what a reader would miss, how to find it).
LESSON_PARTS: list[tuple[str, Callable[[NotebookNode], bool]]] = [
    (
        "a first cell in markdown that asks a question ('?')",
        lambda nb: nb.cells[0].cell_type == "markdown" and "?" in nb.cells[0].source,
    ),
    (
        "a markdown cell that asks the reader to predict ('Predict')",
        lambda nb: any("Predict" in s for s in _cells(nb, "markdown")),
    ),
    (
        "a code cell that shows stepscope's code (`show_source(` or `beside(`, viz/lessons.py)",
        lambda nb: any("show_source(" in s or "beside(" in s for s in _cells(nb, "code")),
    ),
    (
        "a cell that cites the vLLM source it mirrors (vllm/....py)",
        lambda nb: any(re.search(r"vllm/[\w/]+\.py", s) for s in _cells(nb)),
    ),
    (
        "a code cell that draws a Bokeh figure (`figure(` and `show(`)",
        lambda nb: any("figure(" in s and "show(" in s for s in _cells(nb, "code")),
    ),
    ("a markdown heading 'Exercises'", lambda nb: _heading(nb, "Exercises")),
    ("a markdown heading with 'What you measured'", lambda nb: _heading(nb, "What you measured")),
    (
        "a pointer to the guide, docs/request-path.md",
        lambda nb: any("docs/request-path.md" in s for s in _cells(nb)),
    ),
]


def test_one_notebook_per_lesson_each_in_the_readme() -> None:
    prefixes = [p.name[:2] for p in NOTEBOOKS]
    assert prefixes == LESSONS, f"expected one notebook per prefix {LESSONS}, got {prefixes}"
    readme = (TUTORIALS / "README.md").read_text()
    missing = [p.name for p in NOTEBOOKS if p.name not in readme]
    assert not missing, f"tutorials/README.md does not describe {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} hold outputs or execution counts; clear them before "
        "committing (JupyterLab: Edit > Clear Outputs of All Cells, then save)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_has_every_part_of_a_lesson(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    missing = [part for part, present in LESSON_PARTS if not present(notebook)]
    assert not missing, f"{path.name} lacks: " + "; ".join(missing)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_is_one_short_lesson_on_the_shared_helpers(path: Path) -> None:
    """At most 30 cells and 250 code lines; source shown by viz/lessons.py, not a copy of it."""
    notebook = nbformat.read(path, as_version=4)
    code_lines = sum(len(s.splitlines()) for s in _cells(notebook, "code"))
    assert len(notebook.cells) <= 30 and code_lines <= 250, (len(notebook.cells), code_lines)
    own = [
        s for s in _cells(notebook, "code") if re.search(r"^def (show_source|reveal)\b", s, re.M)
    ]
    assert not own, f"{path.name} defines its own source printer; use stepscope.viz.lessons"


@pytest.mark.slow
@pytest.mark.timeout(CELL_TIMEOUT_S * 2)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    # Raises CellExecutionError, with the failing cell and its traceback.
    seconds = RENDERER.execute(notebook, tmp_path, CELL_TIMEOUT_S)
    print(f"{path.name}: {seconds:.1f} s")
