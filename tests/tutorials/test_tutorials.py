"""The JupyterLab tutorials (tutorials/): one notebook per section of the seed, plus a quickstart.

Each notebook is committed without outputs and runs top to bottom on the real engine, asserting
the figures it measures, so a wrong engine fails here. Every notebook runs in a fresh kernel of
this interpreter (the venv's `python3` kernelspec), in a temporary working directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
# The quickstart, then one notebook per section of the seed (shared/seed/BRIEF.md).
SECTIONS = [f"{i:02d}" for i in range(8)]
CELL_TIMEOUT_S = 600


def _ids(path: Path) -> str:
    return path.stem


def test_every_seed_section_has_one_notebook() -> None:
    prefixes = [p.name[:2] for p in NOTEBOOKS]
    assert prefixes == SECTIONS, f"expected one notebook per prefix {SECTIONS}, got {prefixes}"
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
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and "seed" in first.source.lower(), (
        f"{path.name} must open with a markdown cell saying which seed section it covers"
    )


@pytest.mark.slow
@pytest.mark.timeout(CELL_TIMEOUT_S * 2)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.monotonic()
    client.execute()  # raises CellExecutionError, with the failing cell and its traceback
    print(f"{path.name}: {time.monotonic() - start:.1f} s")
