"""Torch reference dequantization of GGML/GGUF quant types.

The plain-torch twin that int8/int4 kernels are tested against, and what the GGUF float loader
uses to turn a tensor's bytes into float32 weights. Every function works on whole tensors (all
blocks at once, no Python loop over blocks) and on any device the bytes are on.

A tensor's bytes are its blocks back to back along the contiguous (last) dimension; each block
holds `block_size` values in `type_size` bytes. Scales `d`/`dmin` are fp16 unless noted; all
multi-byte fields are little-endian. Block layouts (as in llama.cpp's ggml-common.h):

- F32 / F16 / BF16: one value per "block", stored as is (BF16 = the high half of an f32).
- Q8_0  (32 values, 34 B): d, int8 q[32]; x = q * d.
- Q4_0  (32, 18 B): d, 16 B of nibbles (low nibbles are x[0:16], high x[16:32]); x = (q - 8) * d.
- Q4_1  (32, 20 B): d, m, 16 B of nibbles as Q4_0; x = q * d + m.
- Q5_0  (32, 22 B): d, 4 B qh (bit i = 5th bit of x[i]), 16 B nibbles; x = (q - 16) * d.
- Q5_1  (32, 24 B): d, m, qh, nibbles as Q5_0; x = q * d + m.

K-quants use 256-value super-blocks of 16 or 8 sub-blocks, each with its own small scale:

- Q2_K (84 B): 16 B of (4-bit scale | 4-bit min << 4), 64 B of 2-bit q, d, dmin;
  16 sub-blocks of 16; x = d * scale * q - dmin * min.
- Q3_K (110 B): 32 B hmask, 64 B of 2-bit q, 12 B of 16 6-bit scales, d; 16 sub-blocks of 16;
  x = d * (scale - 32) * (q - 4 * (1 - hbit)).
- Q4_K (144 B): d, dmin, 12 B of 8 6-bit scales and 8 6-bit mins, 128 B nibbles;
  8 sub-blocks of 32; x = d * scale * q - dmin * min.
- Q5_K (176 B): d, dmin, 12 B scales/mins as Q4_K, 32 B qh (bit s of qh[l] is the 5th bit of
  x[32 s + l]), 128 B nibbles; x = d * scale * q - dmin * min.
- Q6_K (210 B): 128 B low nibbles, 64 B high 2 bits, int8 scales[16], d; 16 sub-blocks of 16;
  x = d * scale * (q - 32).
- Q8_K (292 B): f32 d, int8 q[256], int16 bsums[16] (sums for dot products, unused here);
  x = q * d.

Packed fields are read in runs of bytes: a run is read once per shift (nibbles: 0 then 4; 2-bit
fields: 0, 2, 4, 6), and each read gives the next values in order (run of 32 bytes at shift 2 of
Q2_K's first half = values 64-95). The per-type functions state each type's runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum

import torch

from aserve.quantization.int_weights import IntWeight, SuperBlocks

QK_K = 256  # values in a K-quant super-block


class GGMLType(IntEnum):
    """The GGML tensor type ids (ggml.h's `enum ggml_type`), as stored in a GGUF file."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (values per block, bytes per block) of the types dequantize() handles.
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.Q8_K: (QK_K, 4 + QK_K + 2 * (QK_K // 16)),
}

SUPPORTED: frozenset[GGMLType] = frozenset(BLOCK_SIZES)


def _type_name(qtype: int | str) -> str:
    if isinstance(qtype, str):
        return qtype
    try:
        return GGMLType(int(qtype)).name
    except ValueError:
        return f"type id {int(qtype)}"


def as_ggml_type(qtype: int | str) -> GGMLType | None:
    """`qtype` (a GGMLType, gguf.GGMLQuantizationType, int id or name) as a GGMLType; None if
    the id or name is unknown."""
    if isinstance(qtype, str):
        return GGMLType.__members__.get(qtype.upper())
    try:
        return GGMLType(int(qtype))
    except ValueError:
        return None


def check_supported(qtype: int | str, name: str = "tensor") -> GGMLType:
    """The GGMLType of `qtype`, or ValueError naming tensor `name` if it cannot be dequantized."""
    t = as_ggml_type(qtype)
    if t not in SUPPORTED:
        supported = ", ".join(sorted(s.name for s in SUPPORTED))
        raise ValueError(f"tensor {name!r} has GGML quant type {_type_name(qtype)}, which aserve "
                         f"cannot dequantize (supported: {supported})")
    return t


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes (last dim) as `dtype`, copying first if they are not aligned."""
    x = x.contiguous()
    if x.storage_offset() % dtype.itemsize:
        x = x.clone()
    return x.view(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of each block, as float32 of shape (n_blocks, 1)."""
    return _as(blocks[:, start:start + 2], torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2, k) 4-bit values: the low nibbles, then the high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _bits(qh: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., k) bytes -> (..., 8 // bits, k) fields of `bits` bits, lowest first."""
    mask = (1 << bits) - 1
    return torch.stack([(qh >> shift) & mask for shift in range(0, 8, bits)], dim=-2)


# --- Plain floats -----------------------------------------------------------------------------

def _dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    return _as(blocks, torch.float32).clone()


def _dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    return _as(blocks, torch.float16).float()


def _dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return _as(blocks, torch.bfloat16).float()


# --- 32-value blocks --------------------------------------------------------------------------

def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(torch.int8).float().mul_(d)


def _q4_values(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of nibbles -> the block's 32 4-bit values (low nibbles first)."""
    return _nibbles(qs).reshape(qs.shape[0], 32)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """4 bytes of high bits (bit i of the little-endian u32 is value i's) + 16 bytes of nibbles
    -> the block's 32 5-bit values."""
    high = _bits(qh, 1).transpose(-1, -2).reshape(qh.shape[0], 32)  # bit i%8 of byte i//8
    return _q4_values(qs) | (high << 4)


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return _q4_values(blocks[:, 2:]).float().sub_(8).mul_(d)  # (q - 8) * d


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _q4_values(blocks[:, 4:]).float().mul_(d).add_(m)  # q * d + m


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return _q5_values(blocks[:, 2:6], blocks[:, 6:]).float().sub_(16).mul_(d)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _q5_values(blocks[:, 4:8], blocks[:, 8:]).float().mul_(d).add_(m)


# --- K-quants: 256-value super-blocks ---------------------------------------------------------

def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = d * (scales & 0x0F).float()  # (n, 16): one per 16-value sub-block
    ml = dmin * (scales >> 4).float()
    # Two halves of 128 values, each from 32 bytes read at shifts 0, 2, 4, 6.
    q = _bits(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return q.mul_(dl.unsqueeze(-1)).sub_(ml.unsqueeze(-1)).reshape(n, QK_K)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales: the low 4 bits are the nibbles of bytes 0-7 (low
    nibbles are scales 0-7), the high 2 bits of scale i are bits 2 (i // 4) of byte 8 + i % 4."""
    n = scales.shape[0]
    low = _nibbles(scales[:, :8]).reshape(n, 16)
    high = _bits(scales[:, 8:], 2).reshape(n, 16)
    return (low | (high << 4)).to(torch.int8) - 32


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    dl = d * _q3_k_scales(scales).float()  # (n, 16)
    low = _bits(qs.reshape(n, 2, 32), 2).reshape(n, 8, 32)  # run r = 4 * half + shift
    high = _bits(hmask, 1)  # (n, 8, 32): bit r of hmask[l] is value 32 r + l's
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)  # a cleared bit subtracts 4
    return q.reshape(n, 16, 16).float().mul_(dl.unsqueeze(-1)).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 6-bit scales and 8 6-bit mins. Sub-blocks 0-3 use the low 6 bits
    of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits from bytes 8-11
    (scale in the low nibble, min in the high) and their high 2 bits from the top of bytes 0-7."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, mn


def _k_apply(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d * scale * q - dmin * min over 8 sub-blocks of 32 (`q`: (n, 8, 32))."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc.float()).unsqueeze(-1)
    ml = (dmin * mn.float()).unsqueeze(-1)
    return q.float().mul_(dl).sub_(ml).reshape(n, QK_K)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Four runs of 32 bytes; each gives two sub-blocks: low nibbles, then high.
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _k_apply(blocks, q)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(blocks[:, 16:48], 1)  # (n, 8, 32): bit s of qh[l] -> sub-block s, value l
    return _k_apply(blocks, low | (high << 4))


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = _f16(blocks, 208)
    # Per half of 128 values: 64 bytes of nibbles (low nibbles are values 0-63, high 64-127) and
    # 32 bytes of 2-bit high parts (shift 2 s is values 32 s + l).
    low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 2, 128)
    high = _bits(qh.reshape(n, 2, 32), 2).reshape(n, 2, 128)
    q = (low | (high << 4)).to(torch.int8) - 32
    dl = (d * scales).unsqueeze(-1)  # (n, 16, 1)
    return q.reshape(n, 16, 16).float().mul_(dl).reshape(n, QK_K)


def _dequant_q8_k(blocks: torch.Tensor) -> torch.Tensor:
    d = _as(blocks[:, :4], torch.float32)
    return blocks[:, 4:4 + QK_K].view(torch.int8).float().mul_(d)


_DEQUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q2_K: _dequant_q2_k,
    GGMLType.Q3_K: _dequant_q3_k,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.Q8_K: _dequant_q8_k,
}


# --- The integer form (`int_weights.IntWeight`): value = scale * q + min per group -------------
# Each returns, for n blocks, q (n, groups, G) uint8, scale and min (n, groups) float32, such that
# scale * q + min is the value `dequantize` computes, exactly; the K-quants also their two levels
# (`Levels`: scale = d * sub-scale, min = dmin * sub-min, d and dmin (n, 1); or, no sub-mins,
# min = -zero * scale).

Levels = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, int]
IntParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, Levels]


def _offset(q: torch.Tensor, d: torch.Tensor, zero: int) -> IntParts:
    """value = d * (q - zero), one group a block."""
    return q.unsqueeze(1), d, d * -zero


def _int_q8_0(blocks: torch.Tensor) -> IntParts:
    q = (blocks[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return _offset(q, _f16(blocks, 0), 128)


def _int_q4_0(blocks: torch.Tensor) -> IntParts:
    return _offset(_q4_values(blocks[:, 2:]), _f16(blocks, 0), 8)


def _int_q4_1(blocks: torch.Tensor) -> IntParts:
    return _q4_values(blocks[:, 4:]).unsqueeze(1), _f16(blocks, 0), _f16(blocks, 2)


def _int_q5_0(blocks: torch.Tensor) -> IntParts:
    return _offset(_q5_values(blocks[:, 2:6], blocks[:, 6:]), _f16(blocks, 0), 16)


def _int_q5_1(blocks: torch.Tensor) -> IntParts:
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:])
    return q.unsqueeze(1), _f16(blocks, 0), _f16(blocks, 2)


def _int_q2_k(blocks: torch.Tensor) -> IntParts:
    n, scales = blocks.shape[0], blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    q = _bits(blocks[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    sc, mn = (scales & 0x0F).to(torch.int8), (scales >> 4).to(torch.int8)
    return q, d * sc.float(), -(dmin * mn.float()), (sc, mn, d, -dmin, 0)


def _int_q3_k(blocks: torch.Tensor) -> IntParts:
    n = blocks.shape[0]
    d, sc = _f16(blocks, 108), _q3_k_scales(blocks[:, 96:108])
    dl = d * sc.float()
    low = _bits(blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    q = low | (_bits(blocks[:, :32], 1) << 2)  # value = dl * (q - 4)
    return q.reshape(n, 16, 16), dl, dl * -4, (sc, None, d, None, 4)


def _int_k(blocks: torch.Tensor, q: torch.Tensor) -> IntParts:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    sc, mn = sc.to(torch.int8), mn.to(torch.int8)  # (6 bits each)
    return q, d * sc.float(), -(dmin * mn.float()), (sc, mn, d, -dmin, 0)


def _int_q4_k(blocks: torch.Tensor) -> IntParts:
    n = blocks.shape[0]
    return _int_k(blocks, _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32))


def _int_q5_k(blocks: torch.Tensor) -> IntParts:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _int_k(blocks, low | (_bits(blocks[:, 16:48], 1) << 4))


def _int_q6_k(blocks: torch.Tensor) -> IntParts:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 128)
    high = _bits(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 2, 128)
    d, sc = _f16(blocks, 208), blocks[:, 192:208].view(torch.int8)
    dl = d * sc.float()
    return (low | (high << 4)).reshape(n, 16, 16), dl, dl * -32, (sc, None, d, None, 32)


_INT: dict[GGMLType, tuple[int, Callable[[torch.Tensor], IntParts]]] = {  # (bits, parts)
    GGMLType.Q8_0: (8, _int_q8_0), GGMLType.Q4_0: (4, _int_q4_0), GGMLType.Q4_1: (4, _int_q4_1),
    GGMLType.Q5_0: (5, _int_q5_0), GGMLType.Q5_1: (5, _int_q5_1), GGMLType.Q2_K: (2, _int_q2_k),
    GGMLType.Q3_K: (3, _int_q3_k), GGMLType.Q4_K: (4, _int_q4_k), GGMLType.Q5_K: (5, _int_q5_k),
    GGMLType.Q6_K: (6, _int_q6_k),
}


def has_int_form(qtype: int | str) -> bool:
    """Whether `int_weight` gives tensors of this type an integer form."""
    return as_ggml_type(qtype) in _INT


def int_weight(raw: torch.Tensor, qtype: int | str, shape: Sequence[int],
               name: str = "tensor") -> IntWeight | None:
    """The integer form (`int_weights.IntWeight`) of a 2-D weight stored in `raw` (as
    `dequantize` takes it), or None for a float type (F32, F16, BF16) or Q8_K, which have
    none."""
    t = check_supported(qtype, name)
    if t not in _INT or len(shape) != 2:
        return None
    if raw.numel() != nbytes(t, shape):
        raise ValueError(f"{t.name} tensor {name!r} of shape {tuple(shape)} needs "
                         f"{nbytes(t, shape)} bytes, got {raw.numel()}")
    bits, parts = _INT[t]
    q, scale, low, *levels = parts(raw.reshape(-1, BLOCK_SIZES[t][1]))
    rows, cols = shape
    group = q.shape[-1]
    blocks = None
    if levels:  # (a K-quant's block is 256 inputs: QK_K)
        sub_scale, sub_min, d, dmin, zero = levels[0]

        def per_block(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if x is None else x.reshape(rows, width)
        blocks = SuperBlocks(per_block(sub_scale, cols // group),
                             per_block(sub_min, cols // group), per_block(d, cols // QK_K),
                             per_block(dmin, cols // QK_K), zero)
    return IntWeight(q.reshape(rows, cols), scale.reshape(rows, cols // group),
                     low.expand_as(scale).reshape(rows, cols // group), group, bits,
                     blocks=blocks)


def nbytes(qtype: int | str, shape: Sequence[int]) -> int:
    """Bytes a tensor of logical `shape` (contiguous dim last) takes in `qtype`; ValueError if the
    type is unsupported or the last dim is not a whole number of blocks."""
    t = check_supported(qtype)
    block_size, type_size = BLOCK_SIZES[t]
    cols = shape[-1] if len(shape) else 1
    if cols % block_size:
        raise ValueError(f"{t.name}: a row of {cols} values is not a whole number of "
                         f"{block_size}-value blocks (shape {tuple(shape)})")
    numel = 1
    for s in shape:
        numel *= s
    return numel // block_size * type_size


def dequantize(raw: torch.Tensor, qtype: int | str, shape: Sequence[int],
               name: str = "tensor") -> torch.Tensor:
    """The float32 tensor of logical `shape` (torch order: rows x cols, cols contiguous; GGUF
    lists dims innermost first, so it is the reverse of the file's) stored in `raw`, the
    tensor's uint8 bytes in GGML type `qtype`. Runs on `raw`'s device."""
    t = check_supported(qtype, name)
    if raw.dtype != torch.uint8:
        raise ValueError(f"{t.name} tensor {name!r}: expected raw uint8 bytes, got {raw.dtype}")
    expected = nbytes(t, shape)
    if raw.numel() != expected:
        raise ValueError(f"{t.name} tensor {name!r} of shape {tuple(shape)} needs {expected} "
                         f"bytes, got {raw.numel()}")
    type_size = BLOCK_SIZES[t][1]
    blocks = raw.reshape(-1, type_size)
    return _DEQUANT[t](blocks).reshape(tuple(shape))
