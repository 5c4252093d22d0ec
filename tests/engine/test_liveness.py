"""engine/liveness.py holds every heartbeat, poll and timeout, and refuses to import when a timeout
no longer spans the intervals it watches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from stepscope.engine import liveness

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "engine" / "liveness.py"
# A module-level constant named like one of these is liveness and belongs in engine/liveness.py.
LIVENESS_NAME = re.compile(r"HEARTBEAT|TIMEOUT|POLL|INTERVAL")
# Start-up and benchmark deadlines, not liveness: they stay with the code that waits.
NOT_LIVENESS = {
    "engine/frontend/engine_group.py": {"STARTUP_TIMEOUT_S"},
    "engine/executor/multiproc_executor.py": {"READY_TIMEOUT_S"},
    "engine/core/core_proc.py": {"HANDSHAKE_TIMEOUT_S"},
    "engine/executor/ray_utils.py": {"PLACEMENT_TIMEOUT_S"},
    "engine/bench/soak.py": {"SETTLE_TIMEOUT_S"},
}


def _liveness_constants(path: Path, root: Path) -> list[str]:
    """`file:line NAME` of each module-level constant of `path` named like liveness."""
    tree = ast.parse(path.read_text(), filename=str(path))
    relative = path.relative_to(root).as_posix()
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            name = getattr(target, "id", "")
            allowed = NOT_LIVENESS.get(relative, set())
            if name.isupper() and LIVENESS_NAME.search(name) and name not in allowed:
                found.append(f"{relative}:{node.lineno} {name}")
    return found


def _import_with(old: str = "", new: str = "") -> None:
    """Run engine/liveness.py's source, with `old` replaced by `new`, as a fresh import would."""
    source = SOURCE.read_text()
    assert old in source
    exec(compile(source.replace(old, new), str(SOURCE), "exec"), {"__name__": "liveness_copy"})


def test_liveness_imports_with_its_relations_holding():
    assert liveness.WORKER_NODE_TIMEOUT_S >= 3 * liveness.WORKER_NODE_HEARTBEAT_S
    assert liveness.DP_RANK_TIMEOUT_S >= 3 * liveness.DP_RANK_REPORT_S
    assert liveness.HEAD_TIMEOUT_S >= 3 * liveness.COORDINATOR_HEARTBEAT_S
    _import_with()  # unchanged, the source runs: the failures below come from the edits


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("WORKER_NODE_TIMEOUT_S = 3.0", "WORKER_NODE_TIMEOUT_S = 1.0", "node timeout"),
        ("IDLE_HEALTH_CHECK_S = 0.5", "IDLE_HEALTH_CHECK_S = 1.5", "executor's looks"),
        ("DP_RANK_REPORT_S = 0.5", "DP_RANK_REPORT_S = 2.0", "DP rank timeout < 3 reports"),
        ("COORDINATOR_HEARTBEAT_S = 1.0", "COORDINATOR_HEARTBEAT_S = 2.0", "head timeout"),
        ("COORDINATOR_PUBLISH_S = 0.1", "COORDINATOR_PUBLISH_S = 1.0", "publishing on change"),
    ],
)
def test_liveness_refuses_to_import_with_a_broken_relation(old, new, message):
    with pytest.raises(AssertionError, match=message):
        _import_with(old, new)


def test_no_other_engine_module_defines_a_heartbeat_or_timeout():
    paths = sorted(p for p in (ROOT / "engine").rglob("*.py") if p != SOURCE)
    assert paths
    assert [hit for path in paths for hit in _liveness_constants(path, ROOT)] == []


def test_constant_checker_finds_a_local_heartbeat(tmp_path):
    """The check above can fail: plain and annotated constants are both seen."""
    source = tmp_path / "engine" / "core" / "thing.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "HEARTBEAT_S = 1.0\nNODE_TIMEOUT_S: float = 3.0\npoll_ms = 100\nREADY_TIMEOUT_S = 300.0\n"
    )
    assert _liveness_constants(source, tmp_path) == [
        "engine/core/thing.py:1 HEARTBEAT_S",
        "engine/core/thing.py:2 NODE_TIMEOUT_S",
        "engine/core/thing.py:4 READY_TIMEOUT_S",
    ]
