"""dtype="auto", as vLLM: the checkpoint's dtype where the device runs it natively."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stepscope.engine.config import EngineConfig, auto_dtype, checkpoint_dtype, cpu_flags
from stepscope.engine.entrypoints.llm import LLM
from stepscope.engine.models.loader import DEFAULT_MODEL, resolve_model
from stepscope.engine.sampling_params import SamplingParams

BF16_CPU = frozenset({"avx512f", "avx512_bf16"})
AMX_CPU = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
OLD_CPU = frozenset({"avx2", "avx512f"})


@pytest.mark.parametrize(
    ("checkpoint", "flags", "chosen", "why"),
    [
        ("float32", AMX_CPU, "float32", "the checkpoint is float32"),
        ("bfloat16", BF16_CPU, "bfloat16", "this CPU has avx512_bf16"),
        ("bfloat16", AMX_CPU, "bfloat16", "this CPU has amx_bf16 and avx512_bf16"),
        ("bfloat16", OLD_CPU, "float32", "would be emulated"),
        ("float16", BF16_CPU, "bfloat16", "the checkpoint is float16"),
        ("float16", OLD_CPU, "float32", "neither amx_bf16 nor avx512_bf16"),
        ("float8_e4m3fn", AMX_CPU, "float32", "not one stepscope runs"),
    ],
)
def test_auto_takes_the_checkpoint_dtype_where_the_cpu_runs_it(
    checkpoint, flags, chosen, why
) -> None:
    dtype, reason = auto_dtype(checkpoint, "cpu", flags)
    assert dtype == chosen
    assert reason.startswith("auto: ") and why in reason


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"), ({}, "float32")],
)
def test_checkpoint_dtype_reads_either_key(tmp_path: Path, fields: dict, expected: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    assert checkpoint_dtype(tmp_path) == expected


def test_the_default_is_auto_and_is_resolved_before_use() -> None:
    config = EngineConfig.create(model="tiny-llama")
    assert config.model_config.dtype == "auto"
    with pytest.raises(RuntimeError, match="resolve"):
        _ = config.model_config.torch_dtype
    m = config.resolve_dtype(resolve_model("tiny-llama")).model_config
    assert (m.dtype, m.dtype_reason) == ("float32", "auto: the checkpoint is float32")
    asked = EngineConfig.create(model="tiny-llama", dtype="float32")
    assert asked.resolve_dtype(resolve_model("tiny-llama")).model_config.dtype_reason == "asked for"
    with pytest.raises(ValueError, match="dtype must be one of 'auto', 'float32'"):
        EngineConfig.create(dtype="fp32")


def test_smollm2_names_its_published_dtype() -> None:
    # The cached weights are the GGUF's dequantized float32 values; config.json names bfloat16.
    assert checkpoint_dtype(resolve_model(DEFAULT_MODEL)) == "bfloat16"


def test_llm_runs_a_bfloat16_checkpoint_in_what_this_cpu_runs_natively(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-bf16"
    shutil.copytree(resolve_model("tiny-llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    expected = auto_dtype("bfloat16", "cpu", cpu_flags())
    with LLM(model=str(folder), num_kv_blocks=16) as llm:
        m = llm.config.model_config
        assert (m.dtype, m.dtype_reason) == expected
        worker_dtype = llm.engine_core.executor.worker.model_runner.dtype
        assert str(worker_dtype) == f"torch.{expected[0]}"
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
