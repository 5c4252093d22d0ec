"""lm-evaluation-harness, unchanged, against `stepscope serve`: its `local-completions` model
scores a small multiple-choice task (shipped with the tests, no hub) through /v1/completions
with `echo` and prompt logprobs, tokenizing through the server's /tokenize (its remote
tokenizer). Its `hf` model scores the same task on the same weights in transformers: each
choice's loglikelihood must agree within 1e-3 (float32) and the accuracies must be equal."""

from __future__ import annotations

import json
import os
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


def run_lm_eval(process_tree, tmp_path: Path, name: str, model: str, model_args: str) -> Path:
    out = tmp_path / name
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"),
           "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(tmp_path / "tasks"), "--batch_size", "8", "--device", "cpu",
           "--log_samples", "--output_path", str(out)]  # fmt: skip
    # No hub: datasets and transformers stay offline, with their caches in the test's folder.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}  # fmt: skip
    result = process_tree.run(cmd, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


def scores(out: Path) -> tuple[dict[int, list[float]], float]:
    """Per document, each choice's loglikelihood; and the task's accuracy."""
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    per_doc = {}
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        per_doc[doc["doc_id"]] = [float(r[0][0]) for r in doc["resps"]]
    [results] = out.rglob("results_*.json")
    return per_doc, json.loads(results.read_text())["results"][TASK]["acc,none"]


@pytest.mark.slow
def test_lm_eval_loglikelihoods_through_stepscope_equal_transformers(tmp_path, process_tree):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / f"{TASK}.yaml").write_text(task_yaml(DATA))
    weights = resolve_model(DEFAULT_MODEL)
    server = Server("--model", DEFAULT_MODEL, "--dtype", "float32", "--no-trace")
    try:
        served = run_lm_eval(
            process_tree, tmp_path, "stepscope", "local-completions",
            f"model={DEFAULT_MODEL},base_url={server.url}/v1/completions,"
            "tokenizer_backend=remote,max_length=2048",
        )  # fmt: skip
    finally:
        server.stop()
    reference = run_lm_eval(
        process_tree, tmp_path, "hf", "hf", f"pretrained={weights},dtype=float32"
    )
    ours, our_acc = scores(served)
    theirs, their_acc = scores(reference)
    assert sorted(ours) == sorted(theirs) == list(range(24))
    worst = max(abs(a - b) for d in ours for a, b in zip(ours[d], theirs[d], strict=True))
    assert worst < 1e-3, worst
    assert our_acc == their_acc
    assert our_acc > 0.5  # 24 questions of 4 choices: far above chance for SmolLM2
