"""GGUF files as checkpoints: every block type in the two packaged GGUFs repacked without
changing an integer (against the `gguf` package's own dequantization), the rows transformers
reorders put in its order, formats mixed by fusion, an unknown type refused by name, and the
default model running its own Q4_1/Q8_0 blocks."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from stepscope.engine.layers.quantization import QuantizedWeight, check_supported, repack
from stepscope.engine.models import gguf as gguf_checkpoint
from stepscope.engine.models.loader import (
    DEFAULT_MODEL,
    gemma3_gguf_path,
    load_weights,
    resolve_config,
    resolve_model,
    smollm2_gguf_path,
)

BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q6_K": 6, "Q8_0": 8}


@functools.cache
def tensors_by_type() -> dict[str, list]:
    """Up to two tensors of each type, from SmolLM2's file (Q4_1, Q8_0) and Gemma 3's (Q4_K,
    Q5_0, Q6_K, Q8_0)."""
    found: dict[str, list] = {}
    for path in (smollm2_gguf_path(), gemma3_gguf_path()):
        for t in gguf_checkpoint.read_tensor_infos(path):
            picked = found.setdefault(t.kind, [])
            if len(picked) < 2 and t.kind != "F32":
                picked.append((t, gguf_checkpoint.tensor_data(path, t)))
    return found


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K"])
def test_repack_keeps_every_integer_of_the_packaged_ggufs(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for t, data in tensors_by_type()[kind]:
        cols, rows = t.shape[0], min(t.shape[1], 4096)
        data = np.asarray(data[:rows])
        w = repack(kind, data, rows, cols)
        u = w.integers()
        assert int(u.max()) < (256 if kind == "Q8_0" else 1 << BITS[kind])
        # scale * u + min in float32 equals the gguf package's float32 dequantization exactly:
        # every scale and min is an fp16 times a small integer, exact in float32.
        want = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, cols)
        assert np.array_equal(w.dequantize().numpy(), want), t.name


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_repack_of_freshly_quantized_blocks(kind):
    """The block types the gguf package can write: random weights, every integer value hit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    x = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    raw = quantize(x, qtype)
    w = repack(kind, raw, 48, 256)
    assert np.array_equal(w.dequantize().numpy(), dequantize(raw, qtype).reshape(48, 256))
    assert int(w.integers().max()) < (256 if kind == "Q8_0" else 1 << BITS[kind])


def test_mixed_formats_concatenate_exactly():
    """Gemma fuses q (Q5_0), k (Q5_0) and v (Q8_0), and its down projection is Q6_K (blocks of
    16): rows of any two forms stack in the wider one, every weight unchanged."""
    t = tensors_by_type()
    parts = []
    for kind in ("Q4_K", "Q6_K", "Q5_0"):
        tensor, data = t[kind][0]
        parts.append(repack(kind, np.asarray(data[:8]), 8, tensor.shape[0]).columns(0, 256))
    fused = QuantizedWeight.cat(parts)
    assert (fused.bits, fused.block, fused.types) == (8, 16, ("Q4_K", "Q6_K", "Q5_0"))
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(fused.dequantize(), want)
    half = 128
    assert torch.equal(fused.columns(0, half).dequantize(), want[:, :half])
    with pytest.raises(ValueError, match="multiples of 32"):
        fused.columns(0, 48)


def test_an_unknown_block_type_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"IQ2_XXS \(e\.g\. blk\.3\.ffn_up\.weight\)"):
        check_supported({"blk.0.attn_norm.weight": "F32", "blk.3.ffn_up.weight": "IQ2_XXS"})
    # In a real file, before the config is built: the header alone is read.
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "q2k.gguf"
    writer = GGUFWriter(str(path), "llama")
    raw = np.zeros((4, 84), dtype=np.uint8)  # four rows of one Q2_K block (256 weights)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / gguf_checkpoint.POINTER).write_text(f'{{"path": "{path}"}}')
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="Q2_K"):
        gguf_checkpoint.resolve_quantization("auto", tmp_path / "ckpt", "cpu")
    assert gguf_checkpoint.resolve_quantization(None, tmp_path / "ckpt", "cpu") is None
    # A GGUF of a family whose tensors are not read here is refused whatever the quantization.
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="model_type 'qwen2' are not read yet"):
        gguf_checkpoint.resolve_quantization(None, tmp_path / "ckpt", "cpu")


def test_quantization_resolves_against_the_checkpoint():
    from stepscope.engine.config import EngineConfig

    smollm2 = resolve_model(DEFAULT_MODEL)
    auto = resolve_config(EngineConfig.create(), smollm2).model_config
    assert (auto.quantization, auto.weight_format) == ("gguf", "gguf (Q4_1, Q8_0)")
    off = resolve_config(EngineConfig.create(quantization=None), smollm2).model_config
    assert off.quantization is None and off.weight_format.endswith("dequantized from GGUF")
    tiny = resolve_config(EngineConfig.create(model="tiny-llama"), resolve_model("tiny-llama"))
    assert tiny.model_config.quantization is None  # safetensors: nothing to run quantized
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        resolve_config(EngineConfig.create(model="tiny-llama", quantization="gguf"),
                       resolve_model("tiny-llama"))  # fmt: skip


def test_the_cli_spells_none():
    import argparse

    from stepscope.engine.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).quantization == "auto"
    assert parser.parse_args(["--quantization", "none"]).quantization is None
    assert parser.parse_args(["--quantization", "gguf"]).quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])


def test_gguf_weights_are_the_dequantized_checkpoints_exactly():
    """The default model's GGUF read directly, q and k rows reordered as transformers does:
    dequantized, every tensor equals the safetensors transformers made of the same file."""
    model_dir = resolve_model(DEFAULT_MODEL)
    from safetensors.torch import load_file

    reference = load_file(str(model_dir / "model.safetensors"))
    quantized = load_weights(model_dir, "gguf")
    dequantized = gguf_checkpoint.load_gguf_weights(model_dir, quantized=False)
    assert set(quantized) == set(dequantized) == set(reference)
    for name, want in reference.items():
        q = quantized[name]
        got = q.dequantize() if isinstance(q, QuantizedWeight) else q
        assert torch.equal(got, want), name
        assert torch.equal(dequantized[name], want), name
    assert isinstance(quantized["model.layers.0.self_attn.q_proj.weight"], QuantizedWeight)
    assert quantized["model.embed_tokens.weight"].types == ("Q8_0",)


@pytest.mark.slow
def test_a_gguf_file_runs_as_the_model():
    """`LLM(model="x.gguf")`: config and tokenizer from the file's metadata, tensors from the
    file; the same greedy tokens as the default model, which reads the same file (in one
    dtype: the file names none, where the default model's config names SmolLM2's bfloat16)."""
    from stepscope.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "def add(a, b):"]
    tokens = {}
    for model in (str(smollm2_gguf_path()), DEFAULT_MODEL):
        with LLM(model=model, num_kv_blocks=64, dtype="float32", quantized_max_tokens=None) as llm:
            assert llm.config.model_config.weight_format == "gguf (Q4_1, Q8_0)"
            tokens[model] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[str(smollm2_gguf_path())] == tokens[DEFAULT_MODEL]
    assert all(len(t) == 12 for t in tokens[DEFAULT_MODEL])
