"""The tutorials' shared helpers (viz/lessons.py): excerpts keep real line numbers, reveals print
before they check, the vLLM pin is one full commit, and the harnesses' pure parts."""

from __future__ import annotations

import inspect
import re
from html.parser import HTMLParser

import pandas as pd
import psutil
import pytest

from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.worker.model_runner import ModelRunner
from stepscope.viz import lessons
from stepscope.viz.lessons import (
    VLLM_PIN,
    Beside,
    beside,
    preemptions,
    process_kind,
    process_table,
    reveal,
    source_excerpt,
    strings_in,
    track_hits,
    vllm_pin_line,
    wait_gone,
)


def _sample(x: int) -> int:
    # first marker
    y = x + 1
    # second marker
    return y


def test_excerpt_carries_the_lines_real_numbers_in_the_file() -> None:
    lines, first = inspect.getsourcelines(_sample)
    excerpt = source_excerpt(_sample, "# first marker", "# second marker")
    assert excerpt.lines == ["    # first marker", "    y = x + 1"]
    assert excerpt.first == first + 1 and excerpt.last == first + 2
    assert excerpt.path == "tests/viz/test_lessons.py"
    assert excerpt.code == "# first marker\ny = x + 1"
    # Each printed line starts with its number in the file.
    printed = str(excerpt).splitlines()
    assert printed[0] == f"tests/viz/test_lessons.py:{first + 1}-{first + 2} · _sample"
    assert printed[1].startswith(f"{first + 1}  # first marker")


def test_excerpt_markers_can_be_predicates_and_include_the_end() -> None:
    excerpt = source_excerpt(_sample, lambda s: "y =" in s, "return", include_end=True)
    assert [s.strip() for s in excerpt.lines] == ["y = x + 1", "# second marker", "return y"]
    whole = source_excerpt(_sample)
    assert whole.lines[0].startswith("def _sample") and whole.lines[-1].strip() == "return y"


def test_a_marker_that_matches_nothing_raises_rather_than_printing_everything() -> None:
    with pytest.raises(ValueError, match="start="):
        source_excerpt(_sample, "no such line")
    with pytest.raises(ValueError, match="end="):
        source_excerpt(_sample, "# first marker", "no such line")


def test_excerpt_of_the_scheduler_names_engine_file() -> None:
    excerpt = source_excerpt(Scheduler.schedule, "# Pass 1", "# Pass 2")
    assert excerpt.path == "engine/core/scheduler.py"
    assert excerpt.lines[0].strip().startswith("# Pass 1")
    file_lines = (lessons.ROOT / excerpt.path).read_text().splitlines()
    assert file_lines[excerpt.first - 1 : excerpt.last] == excerpt.lines
    assert "<span" in excerpt._repr_html_()  # highlighted, with inline line numbers


def test_excerpt_of_a_decorated_function_names_its_own_file() -> None:
    # ModelRunner.execute_model is wrapped by torch.inference_mode, whose wrapper lives in torch.
    excerpt = source_excerpt(ModelRunner.execute_model, "with child_span(names.SAMPLE):")
    assert excerpt.path == "engine/worker/model_runner.py"
    file_lines = (lessons.ROOT / excerpt.path).read_text().splitlines()
    assert file_lines[excerpt.first - 1 : excerpt.last] == excerpt.lines


def test_vllm_pin_is_one_full_commit_and_the_pin_line_names_it() -> None:
    assert re.fullmatch(r"[0-9a-f]{40}", VLLM_PIN.commit)
    line = vllm_pin_line()
    assert VLLM_PIN.commit in line and VLLM_PIN.release in line
    assert VLLM_PIN.url("vllm/v1/engine/core.py").endswith(
        f"/blob/{VLLM_PIN.commit}/vllm/v1/engine/core.py"
    )


def test_beside_prints_the_vllm_side_and_one_differs_line(capsys: pytest.CaptureFixture) -> None:
    kwargs = {
        "vllm_file": "vllm/v1/engine/core.py",
        "vllm_function": "EngineCore.step",
        "summary": "schedules, runs the model, updates",
        "differs": "nothing",
    }
    beside(_sample, "# first marker", "# second marker", **kwargs)
    out = capsys.readouterr().out  # outside IPython it prints its text form
    assert f"vllm/v1/engine/core.py · EngineCore.step @ {VLLM_PIN.short}" in out
    assert out.rstrip().endswith("differs: nothing")
    shown = Beside(source_excerpt(_sample), **kwargs)
    assert repr(shown) == str(shown)  # IPython's plain text is the same text
    assert "differs:" in shown._repr_html_() and VLLM_PIN.commit in shown._repr_html_()


class _Tags(HTMLParser):
    """Each element's tag, class, inline style (as a dict) and the classes of its ancestors."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.elements: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        style = [part.split(":", 1) for part in (attr.get("style") or "").split(";") if part]
        cls = attr.get("class") or ""
        self.elements.append(
            {"tag": tag, "class": cls, "style": {k.strip(): v.strip() for k, v in style}}
        )
        self.elements[-1]["inside"] = list(self.open)
        if tag not in ("br", "hr", "img", "wbr"):  # void elements have no end tag
            self.open.append(cls)

    def handle_endtag(self, tag: str) -> None:
        self.open.pop()


def test_beside_html_is_two_equal_columns_that_shrink_and_wrap_into_a_stack() -> None:
    shown = Beside(
        source_excerpt(Scheduler.schedule, "# Pass 1", "# Pass 2"),
        vllm_file="vllm/v1/core/sched/scheduler.py",
        vllm_function="Scheduler.schedule",
        summary="a <long> summary",
        differs="nothing",
    )
    parser = _Tags()
    parser.feed(shown._repr_html_())
    assert not parser.open, "every element is closed"
    elements = parser.elements
    assert not [e for e in elements if e["tag"] == "table"]  # a table sizes columns by content
    (grid,) = [e for e in elements if e["class"] == "stepscope-beside"]
    columns = [e for e in elements if e["inside"] and e["inside"][-1] == "stepscope-beside"]
    assert [c["class"] for c in columns] == ["stepscope-beside-stepscope", "stepscope-beside-vllm"]
    # Equal tracks (1fr each) no narrower than a minimum, as many as fit: side by side in a wide
    # output, one above the other in a narrow one, never wider than the output (min(100%, ...)).
    assert grid["style"]["display"] == "grid"
    track = grid["style"]["grid-template-columns"]
    assert re.fullmatch(r"repeat\(auto-fit,minmax\(min\(100%,\d+px\),1fr\)\)", track), track
    # A grid column is as wide as its widest line unless its min-width is 0; the code scrolls in
    # its own box, vLLM's prose wraps.
    assert all(c["style"]["min-width"] == "0" for c in columns)
    assert columns[0]["style"]["overflow-x"] == "auto"
    (pre,) = [e for e in elements if e["tag"] == "pre"]  # code scrolls, never wraps mid-word
    assert pre["style"]["white-space"] == "pre" and pre["style"]["overflow-x"] == "auto"
    assert columns[1]["style"]["overflow-wrap"] == "anywhere"
    assert not [e for e in elements if "width" in e["style"]], "no fixed width anywhere"
    text = shown._repr_html_()
    assert "a &lt;long&gt; summary" in text and "<b>differs:</b> nothing" in text


def test_reveal_prints_both_numbers_before_a_failing_check(capsys: pytest.CaptureFixture) -> None:
    reveal(12, 12, "one prefill step, then one per token", what="steps")
    assert capsys.readouterr().out.splitlines() == [
        "steps: you predicted 12; measured 12",
        "  why: one prefill step, then one per token",
    ]
    with pytest.raises(AssertionError, match="predicted 3, measured 4"):
        reveal(3, 4)
    assert "you predicted 3; measured 4" in capsys.readouterr().out


def test_reveal_checks_with_a_tolerance_or_a_custom_check() -> None:
    reveal(1.0, 1.04, rel=0.05)
    with pytest.raises(AssertionError):
        reveal(1.0, 1.2, rel=0.05)
    reveal(10, 3, check=lambda p, m: m < p)
    reveal(pd.Series([1, 2]), [1, 2])  # array-likes compare as lists


def _row(step: int, req: str, before: str, status: str, cb: int, c: int, sched: int, pre: bool):
    return {
        "step": step,
        "request": req,
        "status_before": before,
        "status": status,
        "computed_before": cb,
        "computed": c,
        "scheduled": sched,
        "preempted": pre,
    }


def test_preemptions_count_lost_hit_and_recomputed_tokens() -> None:
    # r1 runs 40 tokens, is preempted in step 3, and comes back in step 6 with 32 tokens cached
    # (two full blocks of 16) and 9 computed again: lost 40, hits 32, recomputed 8.
    track = track_hits(
        pd.DataFrame(
            [
                _row(0, "r1", "WAITING", "RUNNING", 0, 20, 20, False),
                _row(2, "r1", "RUNNING", "RUNNING", 20, 40, 20, False),
                _row(3, "r1", "RUNNING", "PREEMPTED", 40, 0, 0, True),
                _row(6, "r1", "PREEMPTED", "RUNNING", 0, 41, 9, False),
                _row(6, "r0", "RUNNING", "RUNNING", 50, 51, 1, False),
            ]
        )
    )
    assert list(track.hits) == [0, 0, 0, 32, 0]  # a first admission with no hit counts 0
    (event,) = preemptions(track).to_dict("records")
    assert event == {
        "request": "r1",
        "preempted in step": 3,
        "lost": 40,
        "back in step": 6,
        "hits": 32,
        "recomputed": 8,
    }
    assert preemptions(track[track.request == "r0"]).empty


def test_process_kind_from_command_lines() -> None:
    assert process_kind("python -m stepscope.engine.core.core_proc --x") == "engine core"
    assert process_kind("python -c from multiprocessing.spawn import spawn_main") == "worker"
    assert process_kind("python -m stepscope.engine.core.dp_coordinator") == "DP coordinator"
    assert process_kind("python -m stepscope.engine.entrypoints.cli serve") == "API server"
    assert process_kind("bash") == "other"


def test_process_table_lists_this_process_first_and_gone_processes_as_gone() -> None:
    me = psutil.Process()
    table = process_table(me, "this test")
    assert table.iloc[0].to_dict() == {"kind": "this test", "pid": me.pid, "ppid": me.ppid()}
    assert wait_gone([], timeout=0.1)
    assert not wait_gone([me.pid], timeout=0.1)  # this process is alive


def test_strings_in_finds_every_string_keys_included() -> None:
    message = [["r1", [5, 6], {"traceparent": "00-ab"}], 1.5, ("stop",)]
    assert sorted(strings_in(message)) == ["00-ab", "r1", "stop", "traceparent"]
