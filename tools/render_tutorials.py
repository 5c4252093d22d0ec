"""Execute the tutorials and write a copy of each with its outputs, as HTML (`make tutorials`).

Every `tutorials/NN_*.ipynb` runs top to bottom in a fresh kernel of this interpreter, in a
temporary working directory (as the test suite runs them), so whatever a notebook writes stays out
of `tutorials/` and the notebooks on disk keep no outputs. Each becomes `<out>/<name>.html`,
with Bokeh's JavaScript inline so the figures draw from the file alone, offline, and
`<out>/<name>.ipynb`, the executed notebook, whose metadata["stepscope"] says how long it took, on
which machine, when, and from which source (`make site` builds its lesson pages from these copies
rather than running the notebooks again).

A notebook that fails still gets its HTML, up to and including the failing cell and its
traceback; the script then exits with status 1.

    python tools/render_tutorials.py [--only 00 03] [--out build/tutorials] [--timeout 600]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
CELL_TIMEOUT_S = 600
ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


def notebooks(only: list[str] | None = None) -> list[Path]:
    """The tutorials in order; `only` keeps those whose name starts with one of the prefixes."""
    paths = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
    if only:
        paths = [p for p in paths if any(p.name.startswith(prefix) for prefix in only)]
    return paths


def execute(notebook: NotebookNode, workdir: Path, timeout: int = CELL_TIMEOUT_S) -> float:
    """Run `notebook` top to bottom, in place, in a fresh `python3` kernel whose working directory
    is `workdir`; return the seconds it took. Raises CellExecutionError (with the failing cell and
    its traceback) when a cell fails; the cells run so far keep their outputs."""
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.monotonic()
    client.execute()
    return time.monotonic() - start


def to_html(notebook: NotebookNode) -> str:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(notebook)
    return body


def source_digest(path: Path) -> str:
    """What an executed copy records of its source, so a later build can tell it is stale."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def machine() -> str:
    """This machine in a few words, e.g. "2 cores of AMD EPYC"."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores of {cpu}"


def render(path: Path, out_dir: Path, timeout: int) -> tuple[Path, float, str | None]:
    """Execute one tutorial and write its HTML and its executed copy: (html path, seconds, error
    or None)."""
    source = path.read_bytes()  # digested as read: the file may change while this one runs
    notebook = nbformat.reads(source.decode("utf-8"), as_version=4)
    executed_at = datetime.now(UTC)
    error = None
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"tutorial-{path.stem}-") as workdir:
        try:
            execute(notebook, Path(workdir), timeout)
        except CellExecutionError as e:
            error = ANSI_COLOR.sub("", str(e).strip().splitlines()[-1])
    seconds = time.monotonic() - start
    notebook.metadata["stepscope"] = {
        "wall_s": round(seconds, 1),
        "machine": machine(),
        "executed_at": executed_at.isoformat(timespec="seconds"),
        "error": error,
        "source_sha256": hashlib.sha256(source).hexdigest(),
    }
    nbformat.write(notebook, out_dir / path.name)
    html = out_dir / f"{path.stem}.html"
    html.write_text(to_html(notebook), encoding="utf-8")
    return html, seconds, error


def render_all(paths: list[Path], out_dir: Path, timeout: int = CELL_TIMEOUT_S) -> list[str]:
    """Render each of `paths` into `out_dir`, one after the other; return the names that failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Kernels inherit this: output_notebook() then embeds BokehJS instead of loading it from a CDN.
    os.environ["BOKEH_RESOURCES"] = "inline"
    failed = []
    for path in paths:
        html, seconds, error = render(path, out_dir, timeout)
        status = "ok" if error is None else f"FAILED: {error}"
        print(f"{path.name}: {seconds:.1f} s, {status} -> {html}", flush=True)
        if error is not None:
            failed.append(path.name)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="PREFIX", help="e.g. --only 00 03")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "tutorials")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
    args = parser.parse_args(argv)

    paths = notebooks(args.only)
    if not paths:
        print(f"no tutorial matches {args.only}", file=sys.stderr)
        return 2
    failed = render_all(paths, args.out, args.timeout)
    if failed:
        print(f"{len(failed)} of {len(paths)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
