"""lm-evaluation-harness, unchanged, against `stepscope serve`: its `local-completions` model
scores a small multiple-choice task (shipped with the tests, no hub) through /v1/completions
with `echo` and prompt logprobs, tokenizing through the server's /tokenize (its remote
tokenizer). Its `hf` model scores the same task on the same weights in transformers: each
choice's loglikelihood must agree within 1e-3 (float32) and the accuracies must be equal. Both
run through `simple_evaluate`, the harness's evaluation entry point (its CLI's, too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepscope.engine.models.loader import DEFAULT_MODEL, resolve_model
from tests.server_utils import Server

DATA = Path(__file__).parents[2] / "data" / "lm_eval" / "facts.jsonl"
TASK = "stepscope_facts"


def task_yaml(data: Path) -> str:
    return f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


# lm_eval's `simple_evaluate`, as its CLI calls it, with a task index of this task alone: the
# CLI indexes its ~14,000 bundled task files first, ~10 s of each run's CPU time.
SCRIPT = f"""
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

model, model_args, include, out = sys.argv[1:]
tasks = TaskManager(include_path=include, include_defaults=False)
r = simple_evaluate(model=model, model_args=model_args, tasks=["{TASK}"], task_manager=tasks,
                    batch_size=8, device="cpu", log_samples=True)
per_doc = {{s["doc_id"]: [float(x[0][0]) for x in s["resps"]] for s in r["samples"]["{TASK}"]}}
with open(out, "w") as f:
    json.dump({{"per_doc": per_doc, "acc": r["results"]["{TASK}"]["acc,none"]}}, f)
"""


def start_lm_eval(process_tree, tmp_path: Path, name: str, model: str, model_args: str):
    """Start lm_eval; `finish(proc, out)` waits for it. Its output goes to `<name>.log`."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-c", SCRIPT, model, model_args, str(tmp_path / "tasks"), str(out)]
    # No hub: datasets and transformers stay offline, with their caches in the test's folder
    # (each run its own: the two run at once).
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / f"hf-home-{name}")}  # fmt: skip
    with (tmp_path / f"{name}.log").open("w") as log:
        proc = process_tree.popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=log)
    return proc, out


def finish(proc: subprocess.Popen, out: Path) -> tuple[dict[int, list[float]], float]:
    """Per document, each choice's loglikelihood; and the task's accuracy."""
    proc.wait(timeout=900)  # past it, the process_tree fixture kills what is left
    assert proc.returncode == 0, out.with_suffix(".log").read_text()[-8000:]
    scores = json.loads(out.read_text())
    return {int(d): lls for d, lls in scores["per_doc"].items()}, scores["acc"]


@pytest.mark.slow
def test_lm_eval_loglikelihoods_through_stepscope_equal_transformers(tmp_path, process_tree):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / f"{TASK}.yaml").write_text(task_yaml(DATA))
    weights = resolve_model(DEFAULT_MODEL)
    # Most of each lm_eval run is its start-up, not the 96 loglikelihoods: the transformers
    # reference runs while the server starts and is scored.
    reference = start_lm_eval(
        process_tree, tmp_path, "hf", "hf", f"pretrained={weights},dtype=float32"
    )
    ours, our_acc = run_through_server(process_tree, tmp_path, "--quantization", "none")
    theirs, their_acc = finish(*reference)
    assert sorted(ours) == sorted(theirs) == list(range(24))
    worst = max(abs(a - b) for d in ours for a, b in zip(ours[d], theirs[d], strict=True))
    assert worst < 1e-3, worst
    assert our_acc == their_acc
    assert our_acc > 0.5  # 24 questions of 4 choices: far above chance for SmolLM2
    # The GGUF's own blocks (the default): within a point of the dequantized weights, which on
    # 24 questions means the same answers' count.
    _, quantized_acc = run_through_server(process_tree, tmp_path, "--quantization", "gguf")
    assert abs(quantized_acc - our_acc) <= 0.01, (quantized_acc, our_acc)


def run_through_server(process_tree, tmp_path: Path, *flags: str):
    """lm_eval against `stepscope serve` on the default model in float32 with `flags`."""
    server = Server("--model", DEFAULT_MODEL, "--dtype", "float32", "--no-trace", *flags)
    name = "stepscope" + "".join(flags).replace("-", "_")
    try:
        return finish(
            *start_lm_eval(
                process_tree, tmp_path, name, "local-completions",
                f"model={DEFAULT_MODEL},base_url={server.url}/v1/completions,"
                "tokenizer_backend=remote,max_length=2048",
            )
        )  # fmt: skip
    finally:
        server.stop()
