"""tools/build_site.py without Sphinx: which executed lessons it reuses, and what it adds to and
removes from a lesson before Sphinx reads it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from tools import build_site

ROOT = Path(__file__).resolve().parents[2]


BUILDER = build_site


def _executed(
    tmp_path: Path,
    source: Path,
    error: str | None = None,
    wall_s: float = 41.2,
    executed_at: str | None = None,  # now, after any edit of viz/lessons.py
) -> Path:
    """An executed copy of `source`, as tools/render_tutorials.py writes one."""
    notebook = nbformat.read(source, as_version=4)
    notebook.metadata["stepscope"] = {
        "wall_s": wall_s,
        "machine": "2 cores of Test CPU",
        "executed_at": executed_at or datetime.now(UTC).isoformat(timespec="seconds"),
        "error": error,
        "source_sha256": BUILDER.renderer.source_digest(source),
    }
    path = tmp_path / "executed" / source.name
    path.parent.mkdir(exist_ok=True)
    nbformat.write(notebook, path)
    return path


def _lesson(tmp_path: Path) -> Path:
    notebook = new_notebook(
        cells=[
            new_markdown_cell("# 03 · A lesson\n\nWhat is in one step?"),
            new_code_cell(
                "show(p)",
                outputs=[
                    new_output(
                        "display_data",
                        data={
                            "application/javascript": "embed()",
                            "application/vnd.bokehjs_exec.v0+json": "",
                        },
                        metadata={"application/vnd.bokehjs_exec.v0+json": {"id": "p1001"}},
                    )
                ],
            ),
        ]
    )
    path = tmp_path / "03_a_lesson.ipynb"
    nbformat.write(notebook, path)
    return path


def test_executed_copy_is_reused_only_when_made_from_this_notebook_and_passed(tmp_path) -> None:
    source = _lesson(tmp_path)
    assert BUILDER.why_execute(source, tmp_path / "missing.ipynb") == "not executed yet"
    assert BUILDER.why_execute(source, _executed(tmp_path, source)) is None
    failed = _executed(tmp_path, source, error="AssertionError: 3 != 4")
    assert BUILDER.why_execute(source, failed) == "its last run failed"
    executed = _executed(tmp_path, source)
    source.write_text(source.read_text().replace("one step", "two steps"))
    assert BUILDER.why_execute(source, executed) == "the notebook changed since"


def test_executed_copy_is_not_reused_once_the_lesson_helpers_changed(tmp_path) -> None:
    # beside's layout and the excerpts' HTML come from viz/lessons.py, not from the notebook.
    source = _lesson(tmp_path)
    before = _executed(tmp_path, source, executed_at="2001-01-01T00:00:00+00:00")
    assert BUILDER.why_execute(source, before) == "viz/lessons.py changed since"


def test_lesson_page_says_under_its_title_how_long_the_run_took(tmp_path) -> None:
    executed = _executed(
        tmp_path, _lesson(tmp_path), wall_s=130.4, executed_at="2026-01-02T03:04:05"
    )
    page = BUILDER.lesson_page(executed)
    lines = page.cells[0].source.splitlines()
    assert lines[0] == "# 03 · A lesson"
    assert "Executed in 2 min 10 s on 2 cores of Test CPU, 2026-01-02" in lines[2]
    assert lines[-1] == "What is in one step?"


def test_lesson_page_shows_a_failed_run_and_keeps_only_the_figure_script(tmp_path) -> None:
    executed = _executed(tmp_path, _lesson(tmp_path), error="AssertionError: 3 != 4")
    page = BUILDER.lesson_page(executed)
    assert "This run failed: `AssertionError: 3 != 4`" in page.cells[0].source
    assert set(page.cells[1].outputs[0].data) == {"application/javascript"}
