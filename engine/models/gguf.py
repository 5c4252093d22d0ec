"""A GGUF file as a checkpoint (worker start-up; the API process reads its tensor types).

A `.gguf` holds a model's config and tokenizer in its metadata and its tensors in llama.cpp's
names and block formats. stepscope reads it as vLLM does (`--quantization gguf`):
- config and tokenizer: once, through transformers' own GGUF reader, into a folder under
  $STEPSCOPE_CACHE/gguf/ with a config.json and tokenizer files like any checkpoint's, and a
  `gguf.json` naming the file (`prepare_gguf`). Everything that reads a checkpoint's folder
  (the shape, the tokenizer, generation defaults) reads that one.
- tensors: at each start, straight from the file (memory-mapped), renamed to transformers'
  names (`HF_NAMES`), each quantized one repacked as it is (engine/layers/quantization.py), or
  dequantized to float32 by the `gguf` package when quantization is off.

Two families are read: Llama's (`llama`) and Gemma 3's (`gemma3`, its text model). llama.cpp's
converter permutes the rows of Llama's q and k projections (rotary in interleaved pairs);
transformers undoes it, and so does `load_gguf_weights`, on the quantized rows. For Gemma it
stores every norm's weight with 1 added (the 1 + weight its norms multiply by); transformers
subtracts it again, and so does `load_gguf_weights`.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POINTER = "gguf.json"  # in a checkpoint folder: {"path": the .gguf file it reads tensors from}

# llama.cpp's tensor names -> transformers' (Llama family).
LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's: a norm before and after each sub-layer, and q/k norms.
GEMMA3_NAMES = {
    **LLAMA_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# config.json's model_type -> the names its GGUF tensors take.
HF_NAMES = {"llama": LLAMA_NAMES, "gemma3_text": GEMMA3_NAMES}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_file(model_dir: Path) -> Path | None:
    """The .gguf a checkpoint folder reads its tensors from, or None (safetensors)."""
    pointer = Path(model_dir) / POINTER
    if not pointer.exists():
        return None
    return Path(json.loads(pointer.read_text())["path"])


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file, as its header describes it."""

    name: str
    kind: str  # GGUF type name: F32, Q4_1, ...
    shape: tuple[int, ...]  # llama.cpp's order: the contiguous dimension first
    offset: int  # bytes from the start of the file
    nbytes: int


# The GGUF value types' sizes (strings and arrays are read apart), by type id.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def read_tensor_infos(path: Path) -> list[TensorInfo]:
    """The tensors a GGUF file holds, read from its header alone: its metadata values are
    skipped, not decoded (the gguf package's reader decodes every one, a second or more for a
    large vocabulary)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return values

    def string() -> bytes:
        nonlocal pos
        (n,) = take("<Q")
        pos += n
        return data[pos - n : pos]

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == _STRING:
            string()
        elif kind == _ARRAY:
            item, count = take("<IQ")
            if item in _VALUE_SIZES:
                pos += _VALUE_SIZES[item] * count
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            pos += _VALUE_SIZES[kind]

    try:
        magic, version, n_tensors, n_kv = take("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")
        alignment = 32
        for _ in range(n_kv):
            key = string()
            (kind,) = take("<I")
            if key == b"general.alignment" and kind == _UINT32:
                (alignment,) = take("<I")
            else:
                skip_value(kind)
        raw = []
        for _ in range(n_tensors):
            name = string().decode()
            (n_dims,) = take("<I")
            shape = take(f"<{n_dims}Q")
            kind_id, offset = take("<IQ")
            raw.append((name, kind_id, shape, offset))
        start = -(-pos // alignment) * alignment
    finally:
        data.close()
    infos = []
    for name, kind_id, shape, offset in raw:
        try:
            kind = GGMLQuantizationType(kind_id)
        except ValueError:
            raise ValueError(
                f"{path}: tensor {name} has an unknown GGUF type id {kind_id}"
            ) from None
        elements, nbytes = GGML_QUANT_SIZES[kind]
        size = math.prod(shape) // elements * nbytes
        infos.append(TensorInfo(name, kind.name, tuple(shape), start + offset, size))
    return infos


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's GGUF type name, by its name in the file (reads only the header)."""
    return {t.name: t.kind for t in read_tensor_infos(path)}


def tensor_data(path: Path, info: TensorInfo) -> np.ndarray:
    """A tensor's bytes, memory-mapped: [rows, bytes a row] uint8 for quantized blocks, the
    values themselves (float32, float16) for dense tensors."""
    dtype = {"F32": np.float32, "F16": np.float16}.get(info.kind, np.uint8)
    count = info.nbytes // np.dtype(dtype).itemsize
    flat = np.memmap(path, dtype=dtype, mode="r", offset=info.offset, shape=(count,))
    rows = math.prod(info.shape[1:])
    return flat.reshape(rows, -1) if rows > 1 else flat


def check_gguf(model_dir: Path) -> None:
    """Refuse, by name, a block type the kernel has no repack for (before anything starts)."""
    path = gguf_file(model_dir)
    if path is None:
        return
    # Imported only for a GGUF: it brings torch, which the serving process needs for no other.
    from stepscope.engine.layers.quantization import check_supported

    check_supported(tensor_types(path))


def resolve_quantization(asked: str | None, model_dir: str | Path, device: str) -> str | None:
    """ "gguf" where the checkpoint is a GGUF and the device has a kernel for its blocks (the
    CPU's, kernels/cpu/qlinear.c), else None (weights dequantized to dtype). "gguf" asked for
    where it cannot run is refused; so is a GGUF block type without a repack, by name, and a
    GGUF of a family whose tensor names are not read here (any but Llama's and Gemma 3's)."""
    is_gguf = gguf_file(Path(model_dir)) is not None
    if is_gguf:
        _check_family(json.loads((Path(model_dir) / "config.json").read_text()))
    if asked is None:
        return None
    if asked == "gguf" and not is_gguf:
        raise ValueError(f"quantization 'gguf' needs a GGUF checkpoint; {model_dir} is not one")
    if asked == "gguf" and device != "cpu":
        raise ValueError("quantization 'gguf' runs on the CPU only: use quantization=None")
    if not is_gguf or device != "cpu":
        return None
    check_gguf(Path(model_dir))
    return "gguf"


def _check_family(config: dict) -> str:
    """The model_type of a GGUF's config, if its tensors are read here."""
    model_type = config.get("model_type", "llama")
    if model_type not in HF_NAMES:
        raise ValueError(
            f"GGUF files of model_type {config.get('model_type')!r} are not read yet: "
            "stepscope reads Llama-family and Gemma 3 GGUF files"
        )
    return model_type


def hf_name(name: str, model_type: str = "llama") -> str | None:
    """transformers' name of a GGUF tensor, or None for one the decoder does not read."""
    names = HF_NAMES[model_type]
    if (m := _BLOCK.fullmatch(name)) is not None:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    stem, _, kind = name.rpartition(".")
    return f"{names[stem]}.{kind}" if stem in names else None


def _q_k_rows(name: str, rows: int, config: dict) -> np.ndarray | None:
    """The row order that undoes llama.cpp's q/k permutation (Llama's only), or None."""
    if config.get("model_type", "llama") != "llama":
        return None
    heads = config["num_attention_heads"]
    if name.endswith(".attn_q.weight"):
        n_head = heads
    elif name.endswith(".attn_k.weight"):
        n_head = config.get("num_key_value_heads") or heads
    else:
        return None
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def load_gguf_weights(model_dir: Path, quantized: bool) -> dict:
    """Every tensor the decoder reads, by transformers' name: QuantizedWeight for quantized
    blocks when `quantized`, else float32 tensors (the `gguf` package's dequantization, the
    same transformers uses)."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from stepscope.engine.layers.quantization import (
        BLOCK_TYPES,
        DENSE_TYPES,
        check_supported,
        repack,
    )

    config = json.loads((model_dir / "config.json").read_text())
    model_type = _check_family(config)
    path = gguf_file(model_dir)
    infos = read_tensor_infos(path)
    check_supported({t.name: t.kind for t in infos})
    weights: dict = {}
    for t in infos:
        name = hf_name(t.name, model_type)
        if name is None:
            continue
        cols, rows = t.shape[0], math.prod(t.shape[1:])
        order = _q_k_rows(t.name, rows, config)
        data = tensor_data(path, t)
        if quantized and t.kind in BLOCK_TYPES and len(t.shape) > 1:
            w = repack(t.kind, data, rows, cols)
            weights[name] = w if order is None else w.rows(torch.from_numpy(order))
            continue
        if t.kind in DENSE_TYPES:
            values = np.asarray(data, dtype=np.float32)
        else:
            values = dequantize(np.asarray(data), GGMLQuantizationType[t.kind])
        values = values.reshape(rows, cols) if len(t.shape) > 1 else values.reshape(cols)
        if order is not None:
            values = values[order]
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            values = values - 1  # stored as 1 + weight (see the module's docstring)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    return weights


def weight_format(model_dir: Path, quantization: str | None, dtype: str) -> str:
    """What a model's weights run as, for the start-up line and /v1/models: "gguf (Q4_1,
    Q8_0)", "bfloat16, dequantized from GGUF", or the dtype."""
    path = gguf_file(model_dir)
    if path is None:
        return dtype
    if quantization == "gguf":
        from stepscope.engine.layers.quantization import BLOCK_TYPES  # brings torch

        types = sorted({t for t in tensor_types(path).values() if t in BLOCK_TYPES})
        return f"gguf ({', '.join(types)})"
    return f"{dtype}, dequantized from GGUF"


def prepare_gguf(path: Path, cache: Path) -> Path:
    """The checkpoint folder for a .gguf file: config.json, generation_config.json and the
    tokenizer, read from its metadata by transformers once and cached, and gguf.json naming
    the file. Keyed by the file's path, size and modification time."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache / "gguf" / f"{path.stem}-{key}"
    if (target / POINTER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{path.stem}-"))
    try:
        write_gguf_metadata(path, tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_gguf_metadata(path: Path, out: Path) -> None:
    """config.json, generation_config.json, the tokenizer and gguf.json for `path` in `out`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    (out / POINTER).write_text(json.dumps({"path": str(path)}) + "\n")
