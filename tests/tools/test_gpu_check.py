"""tools/gpu_check.py, the one-shot check for the GPU machine, runs every step on CPU in its dry
run: a mistake in the script is found here, not in scarce device time."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = [
    "### 1. Environment (ok",
    "### 2. Kernel tests (ok",
    "### 3. End to end, greedy tokens (ok",
    "### 4. Kernel benchmarks (ok",
    "### 5. Engine throughput (ok",
]


@pytest.mark.slow
def test_dry_run_passes_every_step_and_appends_its_report(tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    out.write_text("# earlier results\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )

    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# earlier results\n\n## GPU check, ")
    for section in SECTIONS:
        assert section in text, section
    assert "result: every check passed" in text
    assert "tokens matched exactly: yes" in text
    assert "| paged attention, decode | bfloat16 |" in text
    assert "| float32 |" in text  # the throughput row
    assert "stepscope imported from /" in text and "gpu-check-" in text
