"""What the tutorials share (stepscope.viz.lessons): printed source, the vLLM pin, reveals and the
lesson harnesses, so that a notebook's cells hold the lesson and not its plumbing.

- `show_source(obj, start, end)`: stepscope's code with its real file and line numbers, whole or
  as an excerpt between two markers (a substring of a line, or a predicate on it), so a long
  function is taught a few lines at a time. `source_excerpt` is the same, returned, not shown.
- `VLLM_PIN`: the one vLLM version every lesson cites (`show_vllm_pin()` prints the line each
  notebook shows in its first vLLM cell). `beside(...)` shows a stepscope excerpt next to (in a
  narrow output, above) a short summary, written here, of the vLLM function it mirrors at that
  commit (file and function name, never vLLM's code) and one "differs:" line.
- `reveal(predicted, measured, why=...)`: prints the prediction and the measurement first, then
  checks the claim, so a prediction is revealed even when the check fails.
- Harnesses: `run_pool` and `preemptions` (a tight KV pool, step by step), `process_table`,
  `process_kind` and `wait_gone` (processes from the OS's table), `strings_in` (the strings inside
  a decoded message). Panel-free; the engine is imported only by `run_pool`.
"""

from __future__ import annotations

import html
import inspect
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import psutil

ROOT = Path(__file__).resolve().parents[1]
Marker = str | Callable[[str], bool] | None


@dataclass(frozen=True, slots=True)
class VllmPin:
    release: str  # how the commit relates to vLLM's releases
    commit: str  # the full SHA every vLLM file and function in the course was read at
    checked: str  # when the course's vLLM claims were last checked against it

    @property
    def short(self) -> str:
        return self.commit[:8]

    def url(self, path: str = "") -> str:
        """The file (or the tree) on GitHub at the pinned commit."""
        kind = "blob" if path else "tree"
        return f"https://github.com/vllm-project/vllm/{kind}/{self.commit}/{path}".rstrip("/")

    def __str__(self) -> str:
        return f"vLLM {self.release}, commit {self.commit}"


VLLM_PIN = VllmPin(
    release="main of February 2026, after release v0.16.0 branched and before v0.17.0",
    commit="b4622cf924bc72504aed99e486062d6633fde39e",
    checked="2026-12-03",
)


def vllm_pin_line() -> str:
    """The line every notebook prints in its first vLLM cell."""
    where = f"{VLLM_PIN} (checked {VLLM_PIN.checked}); {VLLM_PIN.url()}"
    return f"vLLM paths and functions in this lesson: {where}"


def show_vllm_pin() -> None:
    print(vllm_pin_line())


def vllm_ref(path: str, function: str) -> str:
    """`path` · `function` at the pinned commit, e.g. for a table or a print."""
    return f"{path} · {function} @ {VLLM_PIN.short}"


# --- printed source -------------------------------------------------------------------------


def _matches(marker: Marker, line: str) -> bool:
    return marker(line) if callable(marker) else marker in line  # type: ignore[operator]


@dataclass(frozen=True, slots=True, repr=False)
class Excerpt:
    path: str  # relative to the repository root when the file lies in it
    qualname: str
    first: int  # line number in the file of lines[0]
    lines: list[str] = field(repr=False)

    @property
    def last(self) -> int:
        return self.first + len(self.lines) - 1

    @property
    def header(self) -> str:
        return f"{self.path}:{self.first}-{self.last} · {self.qualname}"

    @property
    def code(self) -> str:
        return textwrap.dedent("\n".join(self.lines))

    def __str__(self) -> str:
        width = len(str(self.last))
        body = [
            f"{self.first + i:>{width}}  {line}" for i, line in enumerate(self.code.split("\n"))
        ]
        return "\n".join([self.header, *body])

    __repr__ = __str__  # IPython's plain-text form

    def _repr_html_(self) -> str:
        from pygments import highlight  # IPython's own highlighter
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        # A line wider than the output scrolls inside the code's box: JupyterLab would otherwise
        # wrap it anywhere, mid-word, under the next line's number.
        fmt = HtmlFormatter(
            linenos="inline",
            linenostart=self.first,
            noclasses=True,
            prestyles="white-space:pre;overflow-x:auto",
        )
        head = f"<div style='font-family:monospace;color:#555'>{html.escape(self.header)}</div>"
        return head + highlight(self.code, PythonLexer(), fmt)


def _relative(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def source_excerpt(
    obj: Any, start: Marker = None, end: Marker = None, *, include_end: bool = False
) -> Excerpt:
    """`obj`'s source from the first line matching `start` up to the first later line matching
    `end` (left out unless `include_end`). A marker is a substring of the line or a predicate on
    it; a marker that matches nothing raises ValueError, so a notebook notices when code moves.
    A decorated function is shown from its own file (getsourcelines looks through the decorator's
    wrapper, getsourcefile does not)."""
    obj = inspect.unwrap(obj)
    lines, first = inspect.getsourcelines(obj)
    lines = [line.rstrip("\n") for line in lines]
    qualname = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))

    def find(marker: Marker, lo: int, name: str) -> int:
        i = next((i for i in range(lo, len(lines)) if _matches(marker, lines[i])), None)
        if i is None:
            raise ValueError(f"{qualname}: no line from {first + lo} on matches {name}={marker!r}")
        return i

    begin = 0 if start is None else find(start, 0, "start")
    stop = len(lines) if end is None else find(end, begin + 1, "end") + int(include_end)
    body = lines[begin:stop]
    while body and not body[-1].strip():
        body.pop()
    path = _relative(inspect.getsourcefile(obj) or "?")
    return Excerpt(path, qualname, first + begin, body)


def _display(obj: Any) -> None:
    from IPython import get_ipython
    from IPython.display import display

    (display if get_ipython() is not None else print)(obj)


def show_source(
    obj: Any, start: Marker = None, end: Marker = None, *, include_end: bool = False
) -> None:
    """Show `source_excerpt(obj, start, end)` with its file and real line numbers."""
    _display(source_excerpt(obj, start, end, include_end=include_end))


# How `Beside` lays out in HTML, inline so that JupyterLab and the site draw it alike. Two equal
# columns when the output is wide enough for each to hold about 80 characters of code (JupyterLab
# at 1600 px), else stacked, stepscope's excerpt above vLLM's summary (the site's article,
# JupyterLab at 1000 px). `min-width:0` lets a column be narrower than its widest code line, which
# then scrolls inside its own box instead of widening the column and squeezing vLLM's; vLLM's side
# is prose and wraps, long paths included.
BESIDE_CLASS = "stepscope-beside"
BESIDE_MIN_COLUMN_PX = 640
_GRID = (
    "display:grid;grid-template-columns:"
    f"repeat(auto-fit,minmax(min(100%,{BESIDE_MIN_COLUMN_PX}px),1fr));"
    "gap:0.75em 1.5em;align-items:start;max-width:100%"
)
_OURS = "min-width:0;overflow-x:auto"
_VLLM = "min-width:0;overflow-wrap:anywhere;border-left:3px solid #ccc;padding-left:0.75em"


@dataclass(frozen=True, slots=True, repr=False)
class Beside:
    excerpt: Excerpt
    vllm_file: str
    vllm_function: str
    summary: str  # what vLLM's function does, in the course's words
    differs: str

    def __str__(self) -> str:
        vllm = f"vLLM {vllm_ref(self.vllm_file, self.vllm_function)}: {self.summary}"
        return f"{self.excerpt}\n{vllm}\ndiffers: {self.differs}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = html.escape
        link = f"<a href='{VLLM_PIN.url(self.vllm_file)}'>{esc(self.vllm_file)}</a>"
        code = self.excerpt._repr_html_()
        ours = f"<div class='{BESIDE_CLASS}-stepscope' style='{_OURS}'>{code}</div>"
        vllm = (
            f"<div class='{BESIDE_CLASS}-vllm' style='{_VLLM}'>"
            f"<div style='font-family:monospace;color:#555'>vLLM {link} · "
            f"{esc(self.vllm_function)} @ {VLLM_PIN.short}</div>"
            f"<p style='margin:0.25em 0 0 0'>{esc(self.summary)}</p></div>"
        )
        return (
            f"<div class='{BESIDE_CLASS}' style='{_GRID}'>{ours}{vllm}</div>"
            f"<p><b>differs:</b> {esc(self.differs)}</p>"
        )


def beside(
    obj: Any,
    start: Marker = None,
    end: Marker = None,
    *,
    vllm_file: str,
    vllm_function: str,
    summary: str,
    differs: str,
    include_end: bool = False,
) -> None:
    """Show a stepscope excerpt beside what vLLM's `vllm_function` in `vllm_file` does at the
    pinned commit (a summary in the course's words: never paste vLLM's code), then one
    "differs:" line."""
    excerpt = source_excerpt(obj, start, end, include_end=include_end)
    _display(Beside(excerpt, vllm_file, vllm_function, summary, differs))


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value  # pandas, numpy: lists, scalars


def _fmt(value: Any) -> str:
    value = _plain(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _same(predicted: Any, measured: Any, rel: float | None) -> bool:
    predicted, measured = _plain(predicted), _plain(measured)
    if rel is not None:
        return abs(measured - predicted) <= rel * abs(predicted)
    return bool(predicted == measured)


def reveal(
    predicted: Any,
    measured: Any,
    why: str = "",
    *,
    what: str = "",
    check: Callable[[Any, Any], bool] | None = None,
    rel: float | None = None,
) -> None:
    """Print "you predicted X; measured Y" (and `why`), then check the claim: `check(predicted,
    measured)` when given, else equality (within `rel`, relative, for numbers). The print comes
    first, so a failing claim still shows both numbers before its AssertionError."""
    prefix = f"{what}: " if what else ""
    print(f"{prefix}you predicted {_fmt(predicted)}; measured {_fmt(measured)}")
    if why:
        print(f"  why: {why}")
    ok = check(predicted, measured) if check is not None else _same(predicted, measured, rel)
    if not ok:
        claim = f"predicted {_fmt(predicted)}, measured {_fmt(measured)}"
        raise AssertionError(f"{prefix}the claim does not hold: {claim}")


# --- harness: a tight KV pool, step by step --------------------------------------------------


@dataclass(slots=True)
class PoolRun:
    """One `run_pool`: per request per step (`track`), the engine's `steps` view, each
    preemption's victims with the running list before it, and every request's output tokens."""

    num_blocks: int
    caching: bool
    track: pd.DataFrame
    steps: pd.DataFrame
    victims: list[dict[str, list[str]]]
    tokens: list[list[int]]
    seconds: float

    def summary(self) -> dict[str, int | float]:
        return {
            "steps": len(self.steps),
            "preemptions": int(self.steps.num_preempted.sum()),
            "max waiting": int(self.steps.num_waiting.max()),
            "tokens scheduled": int(self.track.scheduled.sum()),
            "prefix-hit tokens": int(self.steps.prefix_hit_tokens.sum()),
            "seconds": round(self.seconds, 2),
        }


def track_hits(track: pd.DataFrame) -> pd.DataFrame:
    """Add `hits`: for a request admitted in a step (not RUNNING before, RUNNING after), its
    progress after the step less what the step scheduled, i.e. its prefix-cache hit tokens."""
    admitted = (track.status_before != "RUNNING") & (track.status == "RUNNING")
    return track.assign(hits=(track.computed - track.scheduled).where(admitted, 0))


_TRACK = ["step", "request", "status_before", "computed_before", "status", "computed", "preempted"]


def run_pool(
    prompts: list[list[int]],
    params: Any,
    *,
    num_blocks: int,
    budget: int,
    caching: bool,
    trace_db: Path,
    model: str = "tiny-llama",
) -> PoolRun:
    """Add `prompts` as requests r0, r1, ... to a fresh in-process engine and drive its steps by
    hand, recording each request's status and `num_computed_tokens` before and after every step
    and who was preempted; what each step scheduled comes from the trace."""
    from stepscope.engine import LLM

    rows, victims = [], []
    with LLM(
        model=model,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        trace_db=trace_db,
    ) as llm:
        core = llm.engine_core
        for i, ids in enumerate(prompts):
            core.add_request(llm.processor.process(f"r{i}", ids, params))
        reqs = [core.scheduler.requests[f"r{i}"] for i in range(len(prompts))]
        start = time.perf_counter()
        while core.has_unfinished_requests():
            before = [(r.num_computed_tokens, r.status.name) for r in reqs]
            running = [r.request_id for r in core.scheduler.running]  # in admission order
            core.step()
            stats = core.scheduler.last_stats
            if stats.preempted:
                victims.append({"preempted": list(stats.preempted), "running before": running})
            for r, (computed, status) in zip(reqs, before, strict=True):
                row = (r.request_id, status, computed, r.status.name, r.num_computed_tokens)
                rows.append((stats.step, *row, r.request_id in stats.preempted))
        seconds = time.perf_counter() - start
        scheduled = llm.query_traces(
            "SELECT step, request_id AS request, num_tokens AS scheduled FROM step_requests"
        )
        steps = llm.query_traces("SELECT * FROM steps ORDER BY step")
    track = pd.DataFrame(rows, columns=_TRACK).merge(scheduled, on=["step", "request"], how="left")
    track["scheduled"] = track.scheduled.fillna(0).astype(int)
    tokens = [list(r.output_token_ids) for r in reqs]
    return PoolRun(num_blocks, caching, track_hits(track), steps, victims, tokens, seconds)


def preemptions(track: pd.DataFrame) -> pd.DataFrame:
    """One row per preemption in a `PoolRun.track`: when the request was preempted and came back,
    the progress it `lost`, the `hits` the prefix cache still held on re-admission, and the
    tokens `recomputed` (lost - hits)."""
    out = []
    for rid, g in track.groupby("request"):
        gone = g[g.preempted]
        back = g[(g.status_before == "PREEMPTED") & (g.status == "RUNNING")]
        for (_, p), (_, b) in zip(gone.iterrows(), back.iterrows(), strict=True):
            lost = p.computed_before
            out.append((rid, p.step, lost, b.step, b.hits, lost - b.hits))
    columns = ["request", "preempted in step", "lost", "back in step", "hits", "recomputed"]
    return pd.DataFrame(out, columns=columns)


_KINDS = [
    ("stepscope.engine.core.core_proc", "engine core"),
    ("stepscope.engine.core.dp_coordinator", "DP coordinator"),
    ("multiprocessing.resource_tracker", "resource tracker"),
    ("multiprocessing.spawn", "worker"),
    ("stepscope.traces.backend.collector", "trace collector"),
    ("stepscope.engine.entrypoints.cli serve", "API server"),
]


def process_kind(cmdline: str) -> str:
    """A stepscope process's role, from its command line: the engine core and the coordinator
    are `python -m` modules, a worker is a multiprocessing spawn child."""
    return next((kind for marker, kind in _KINDS if marker in cmdline), "other")


def process_table(root: Any, root_kind: str = "front end (this kernel)") -> pd.DataFrame:
    """The OS's view (psutil): `root` and every process below it, as kind, pid, ppid."""
    rows = [(root_kind, root.pid, root.ppid())]
    for p in root.children(True):
        try:
            rows.append((process_kind(" ".join(p.cmdline())), p.pid, p.ppid()))
        except psutil.Error:  # exited, or a zombie not yet reaped: no longer running anything
            continue
    return pd.DataFrame(rows, columns=["kind", "pid", "ppid"])


def wait_gone(pids: Iterable[int], timeout: float = 15.0) -> bool:
    """Whether every process in `pids` has exited (or is a zombie) within `timeout` seconds."""

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    pids, deadline = list(pids), time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(pid) for pid in pids)


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside a decoded message (lists, tuples and dicts, keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple | dict):
        items = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
        for v in items:
            yield from strings_in(v)
