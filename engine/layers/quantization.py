"""GGUF's quantized blocks, repacked for the CPU kernel without changing an integer (worker
start-up; the products run in stage 6).

A GGUF tensor stores each run of 32 or 256 weights as small integers with one or two fp16
numbers. Every block type here comes down to the same form, the one
kernels/cpu/qlinear.c runs:

    w = scale * u + min      u an unsigned integer, one scale and one min per block of 32 (16)

| GGUF type | bytes / 32 weights | u          | scale    | min          | block | stored as |
|-----------|--------------------|------------|----------|--------------|-------|-----------|
| Q4_0      | 18                 | q (0..15)  | d        | -8 d         | 32    | 4 bits    |
| Q4_1      | 20                 | q (0..15)  | d        | m            | 32    | 4 bits    |
| Q4_K      | 18 (144 / 256)     | q (0..15)  | d * sc   | -dmin * mn   | 32    | 4 bits    |
| Q5_0      | 22                 | q (0..31)  | d        | -16 d        | 32    | 8 bits    |
| Q6_K      | 26.25 (210 / 256)  | q (0..63)  | d * sc   | -32 d * sc   | 16    | 8 bits    |
| Q8_0      | 34                 | q + 128    | d        | -128 d       | 32    | 8 bits    |

The integers are the file's (Q8_0's shifted by 128 so that every u is unsigned, as the kernel's
unsigned-by-signed byte products want); scales and mins are float32, in which every product
above is exact (an fp16 times an integer of at most 8 bits), so no weight is requantized and
no scale rounded. What it costs: scales and mins take 8 bytes a block where the file's fp16
took 2 to 4 (Q4_1: 24 bytes a block against 20), and 5- and 6-bit integers a byte each.

F32 and F16 tensors (norms) are not quantized and stay tensors. Any other type is refused by
name (`check_supported`) before an engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

# GGUF type name -> (elements per block, bytes per block)
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q5_0": (32, 22),
    "Q6_K": (256, 210),
    "Q8_0": (32, 34),
}
DENSE_TYPES = ("F32", "F16")
SUPPORTED_TYPES = (*DENSE_TYPES, *BLOCK_TYPES)


def check_supported(types: dict[str, str]) -> None:
    """Refuse a checkpoint holding a tensor type the CPU kernel has no repack for; `types`
    maps each tensor's name to its GGUF type name."""
    unknown = sorted({t for t in types.values() if t not in SUPPORTED_TYPES})
    if unknown:
        first = {t: next(n for n, tt in types.items() if tt == t) for t in unknown}
        named = ", ".join(f"{t} (e.g. {first[t]})" for t in unknown)
        raise ValueError(
            f"GGUF block type {named} is not supported: stepscope runs "
            f"{', '.join(SUPPORTED_TYPES)}; run with quantization=None to dequantize instead "
            "(as transformers does)"
        )


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out_features, in_features] as the kernel reads it: `qs` the integers
    ([out, in * bits / 8] uint8; bits 4: byte i of a 32-block holds element i in its low
    nibble and element i + 16 in its high one), `scales` and `mins` [out, in / block] float32.
    `dense`: the same weight dequantized and packed for the dense GEMM, for steps large enough
    that FLOPs, not bytes, bound them (QuantizedLinear); None until the model packs it."""

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    block: int
    types: tuple[str, ...]  # the GGUF block types its rows came from
    dense: object = None
    kernel: object = None  # the product, ready to call (QuantizedLinear.pack)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins))

    def integers(self) -> torch.Tensor:  # [out, in] uint8, u of every weight
        if self.bits == 8:
            return self.qs
        rows, cols = self.shape
        q = self.qs.view(rows, cols // 32, 16)
        return torch.cat([q & 0x0F, q >> 4], dim=-1).reshape(rows, cols)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        rows, cols = self.shape
        u = self.integers().view(rows, cols // self.block, self.block).float()
        w = u * self.scales[..., None] + self.mins[..., None]
        return w.reshape(rows, cols)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [n, in] float32: the rows `ids`
        picked = QuantizedWeight(
            self.qs[ids], self.scales[ids], self.mins[ids], self.bits, self.block, self.types
        )
        return picked.dequantize()

    def as_format(self, bits: int, block: int) -> QuantizedWeight:
        """The same integers stored wider (4 -> 8 bits) or in smaller blocks (32 -> 16, each
        scale and min repeated): what concatenating rows of different types needs."""
        w = self
        if bits == 8 and w.bits == 4:
            w = replace(w, qs=w.integers().contiguous(), bits=8)
        if block == 16 and w.block == 32:
            s, m = (t.repeat_interleave(2, dim=1) for t in (w.scales, w.mins))
            w = replace(w, scales=s, mins=m, block=16)
        if (w.bits, w.block) != (bits, block):
            raise ValueError(f"cannot store {w.bits}-bit blocks of {w.block} as {bits}/{block}")
        return w

    def rows(self, index) -> QuantizedWeight:
        """Some output rows (a slice, or an index tensor)."""
        return replace(self, qs=self.qs[index], scales=self.scales[index], mins=self.mins[index])

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input features start..stop (a row-parallel shard), at block boundaries."""
        if start % 32 or stop % 32:
            raise ValueError(
                f"a quantized weight splits only at multiples of 32 input features, not "
                f"{start}:{stop} (choose a tensor_parallel_size that divides it so)"
            )
        b = self.bits
        return replace(
            self,
            qs=self.qs[:, start * b // 8 : stop * b // 8].contiguous(),
            scales=self.scales[:, start // self.block : stop // self.block].contiguous(),
            mins=self.mins[:, start // self.block : stop // self.block].contiguous(),
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows stacked (fused q/k/v, gate/up), in the widest form any part needs."""
        bits, block = max(p.bits for p in parts), min(p.block for p in parts)
        parts = [p.as_format(bits, block) for p in parts]
        types = tuple(dict.fromkeys(t for p in parts for t in p.types))
        return QuantizedWeight(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "scales", "mins")),
            bits=bits,
            block=block,
            types=types,
        )


def repack(kind: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's bytes (`rows` x `cols` weights of type `kind`) as a QuantizedWeight."""
    if kind not in BLOCK_TYPES:
        check_supported({"tensor": kind})
        raise ValueError(f"{kind} is not a quantized block type")
    size, nbytes = BLOCK_TYPES[kind]
    if cols % size:
        raise ValueError(f"{kind}: {cols} columns are not whole blocks of {size}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if blocks.shape[0] != rows * cols // size:
        raise ValueError(f"{kind}: {blocks.shape[0]} blocks do not make {rows} x {cols}")
    u, scales, mins, block = _UNPACK[kind](blocks)
    bits = 4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8
    u = u.reshape(rows, cols)
    if bits == 4:  # two a byte: element i low, element i + 16 high, per 32
        u = u.reshape(rows, cols // 32, 2, 16)
        u = u[:, :, 0] | (u[:, :, 1] << 4)
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(u.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1), dtype=np.float32)),
        bits=bits,
        block=block,
        types=(kind,),
    )


def _f16(column: np.ndarray) -> np.ndarray:  # [n, 2] bytes -> [n] float32
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] -> [n, 32]: low nibbles, then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d, 32


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q5_0(b):
    d = _f16(b[:, :2])
    high = np.unpackbits(b[:, 2:6], axis=-1, bitorder="little")  # bit j: element j's fifth
    return _nibbles(b[:, 6:]) | (high << 4), d, -16 * d, 32


def _q8_0(b):
    d = _f16(b[:, :2])
    u = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return u, d, -128 * d, 32


def _q4_k(b):
    """256 weights: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles
    (each 32 bytes: one sub-block in the low nibbles, the next in the high ones)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    s = b[:, 4:16].reshape(n, 3, 4)
    lo, hi, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    u = (qs & 0x0F).reshape(n, 8, 32)
    return u, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 32


def _q6_k(b):
    """256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales
    (one per 16 weights), then d."""
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])[:, None]
    low = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, 8, 32)
    high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 8, 32)
    scale = d * sc.view(np.int8).astype(np.float32)
    return (low | (high << 4)).reshape(n, 256), scale, -32 * scale, 16


_UNPACK = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_0": _q5_0,
    "Q6_K": _q6_k,
    "Q8_0": _q8_0,
}
