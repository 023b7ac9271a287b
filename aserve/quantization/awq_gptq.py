"""Torch reference dequantization (and packing) of AWQ and GPTQ checkpoint tensors.

The plain-torch twin that int4/int8 kernels are tested against, and what the float reference
loader uses to serve such HF checkpoints at float32. Whole tensors at once (no Python loop over
elements), on any device the tensors are on. Every result is float32 in the HF Linear weight
layout W[out_features, in_features] and exact: (q - z) is a small integer and s an fp16 value,
so their product fits float32's mantissa.

Packed words are int32 read as unsigned 32-bit; "little-endian bit stream" below means value v of
a packed run sits at bits [v * bits, (v + 1) * bits) of the run's words, word 0 holding bits
0-31 (low bits first). For 2, 4 and 8 bits that is word v // (32 / bits) at shift
(v % (32 / bits)) * bits; for 3 bits, 32 values take 3 words and values 10 and 21 straddle words.

GPTQ (AutoGPTQ / GPTQModel; vLLM's `gptq` and `gptq_marlin`; `quant_method: "gptq"`),
bits 2, 3, 4, 8:

- qweight int32 [in * bits / 32, out]: each column is a bit stream of the input rows (packed
  along the input dim).
- qzeros int32 [n_groups, out * bits / 32]: each row is a bit stream of the output columns.
- scales fp16 [n_groups, out].
- g_idx int32 [in]: the group of each input row; i // group_size, or with act-order
  (`desc_act: true`) a non-monotone map (rows stay in checkpoint order, only groups permute).
- W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], with z = stored field + zero_offset:
  `checkpoint_format: "gptq"` (v1; the default when the key is absent, what AutoGPTQ wrote) stores
  zero - 1, so zero_offset = 1 and z is in [1, 2^bits]; `"gptq_v2"` stores the zero itself,
  zero_offset = 0. A symmetric v1 4-bit checkpoint thus stores qzeros = 0x77777777 (z = 8).

AWQ GEMM (AutoAWQ `version: "gemm"`; vLLM's `awq` and `awq_marlin`; `quant_method: "awq"`),
4 bits only:

- qweight int32 [in, out / 8]: packed along the output dim; word w of a row holds columns
  8w .. 8w+7, its nibble k (shift 4k) holding column 8w + AWQ_PACK_ORDER[k], with
  AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7) (so column 8w + j is nibble AWQ_UNPACK_ORDER[j],
  (0, 4, 1, 5, 2, 6, 3, 7)).
- qzeros int32 [in / group_size, out / 8]: the zeros themselves (no offset), packed the same way.
- scales fp16 [in / group_size, out].
- W[o, i] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o].

`pack_gptq` / `pack_awq` are the inverses (integer codes, zeros and scales to stored tensors),
for building small checkpoints in tests and for kernel repacking. Malformed inputs raise
ValueError naming the tensor and what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aserve.quantization.int_weights import IntWeight

GPTQ_BITS = (2, 3, 4, 8)
AWQ_BITS = (4,)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_PACK_ORDER[k]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word is nibble AWQ_UNPACK_ORDER[j]
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> zero_offset


@dataclass(frozen=True)
class GroupedCodes:
    """What GPTQ and AWQ tensors hold, unpacked: W[o, i] = (codes[i, o] - zeros[g, o]) *
    scales[g, o] with g = groups[i]."""

    codes: torch.Tensor  # [in, out], in [0, 2^bits)
    zeros: torch.Tensor  # float32 [n_groups, out]
    scales: torch.Tensor  # float32 [n_groups, out]
    groups: torch.Tensor  # int64 [in]
    bits: int

    def dequantize(self) -> torch.Tensor:
        w = (self.codes.float() - self.zeros[self.groups]) * self.scales[self.groups]
        return w.t().contiguous()

    def int_weight(self) -> IntWeight | None:
        """scale * q + min per group (min = -scale * zero). GPTQ's act-order groups (inputs
        of a group not consecutive) come with their columns sorted by group (`perm`); None
        where the groups are not all of one size."""
        in_features, n_groups = self.codes.shape[0], self.scales.shape[0]
        if in_features % n_groups:
            return None
        size = in_features // n_groups
        groups = self.groups.cpu()
        runs = torch.arange(in_features) // size
        perm = None
        if not torch.equal(groups, runs):
            perm = torch.sort(groups, stable=True).indices
            if not torch.equal(groups[perm], runs):
                return None  # groups of different sizes
        codes = self.codes if perm is None else self.codes[perm.to(self.codes.device)]
        scale = self.scales.t().contiguous()
        return IntWeight(codes.t().to(torch.uint8).contiguous(), scale,
                         (-scale * self.zeros.t()).contiguous(), size, self.bits, perm)


def gptq_zero_offset(checkpoint_format: str | None) -> int:
    """The zero_offset for a GPTQ `checkpoint_format` (None, i.e. absent, means v1 "gptq")."""
    fmt = "gptq" if checkpoint_format is None else checkpoint_format.lower()
    if fmt not in GPTQ_ZERO_OFFSETS:
        raise ValueError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not one of "
            f"{sorted(GPTQ_ZERO_OFFSETS)}"
        )
    return GPTQ_ZERO_OFFSETS[fmt]


# ---- validation helpers ----------------------------------------------------------------------


def _check_bits(fmt: str, bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ValueError(f"{fmt}: bits={bits} is not supported (supported: {list(allowed)})")


def _check_gptq(bits: int, zero_offset: int) -> None:
    _check_bits("gptq", bits, GPTQ_BITS)
    if zero_offset not in (0, 1):
        raise ValueError(f"gptq: zero_offset={zero_offset} must be 1 (v1 'gptq') or 0 ('gptq_v2')")


def _check_tensor(fmt: str, name: str, t: torch.Tensor, kind: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fmt} {name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{fmt} {name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if kind == "int32" and t.dtype != torch.int32:
        raise ValueError(f"{fmt} {name}: expected dtype torch.int32, got {t.dtype}")
    if kind == "int" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(f"{fmt} {name}: expected an integer dtype, got {t.dtype}")
    if kind == "float" and not t.dtype.is_floating_point:
        raise ValueError(f"{fmt} {name}: expected a floating dtype, got {t.dtype}")


def _check_shape(fmt: str, name: str, t: torch.Tensor, expected: tuple[int, ...], what: str):
    if tuple(t.shape) != expected:
        raise ValueError(
            f"{fmt} {name}: expected shape {expected} = ({what}), got {tuple(t.shape)}"
        )


def _packed_len(fmt: str, name: str, n_values: int, bits: int, what: str) -> int:
    """Words holding `n_values` values of `bits` bits; they must fill whole words."""
    if n_values * bits % 32:
        per = 32 // bits if 32 % bits == 0 else 32
        raise ValueError(
            f"{fmt} {name}: {what}={n_values} must be a multiple of {per} to pack {bits}-bit "
            "values into whole int32 words"
        )
    return n_values * bits // 32


def _resolve_group_size(fmt: str, in_features: int, group_size: int) -> int:
    if group_size == -1:
        return in_features
    if group_size <= 0:
        raise ValueError(f"{fmt}: group_size={group_size} must be positive or -1")
    if in_features % group_size:
        raise ValueError(
            f"{fmt}: group_size={group_size} does not divide in_features={in_features}"
        )
    return group_size


def _check_codes(fmt: str, name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(
            f"{fmt} {name}: values must lie in [{lo}, {hi}], got [{int(t.min())}, {int(t.max())}]"
        )


# ---- bit-stream packing ------------------------------------------------------------------------


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack int32 `words` along `dim`, a little-endian bit stream of `bits`-bit values, into
    int32 values (the dim grows by 32 / bits)."""
    w = words.movedim(dim, -1)
    mask = (1 << bits) - 1
    if 32 % bits == 0:  # values never straddle words: shift each word once per slot
        shifts = torch.arange(0, 32, bits, device=w.device, dtype=torch.int32)
        vals = (w.unsqueeze(-1) >> shifts) & mask  # arithmetic shift; the mask drops sign bits
        vals = vals.flatten(-2)
    else:  # general stream (3 bits): gather the word(s) under each value, in int64
        u = w.to(torch.int64) & 0xFFFFFFFF
        n_words = u.shape[-1]
        offs = torch.arange(n_words * 32 // bits, device=w.device) * bits
        word, shift = offs // 32, offs % 32
        nxt = (word + 1).clamp(max=max(n_words - 1, 0))
        vals = ((u[..., word] >> shift) | (u[..., nxt] << (32 - shift))) & mask
        vals = vals.to(torch.int32)
    return vals.movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer `values` in [0, 2^bits) along `dim` into int32 words, a little-endian bit
    stream (the dim shrinks by 32 / bits; its length times bits must be a multiple of 32)."""
    v = values.movedim(dim, -1).to(torch.int64)
    n = v.shape[-1]
    n_words = n * bits // 32
    offs = torch.arange(n, device=v.device) * bits
    word, shift = offs // 32, offs % 32
    placed = v << shift  # up to 32 + bits - 1 bits: the part above bit 31 spills to the next word
    out = torch.zeros((*v.shape[:-1], n_words + 1), dtype=torch.int64, device=v.device)
    out.index_add_(-1, word, placed & 0xFFFFFFFF)  # fields never overlap, so adding is OR
    out.index_add_(-1, word + 1, placed >> 32)
    out = out[..., :n_words]
    out = out - ((out >> 31) & 1) * (1 << 32)  # unsigned 32-bit -> two's complement int32
    return out.to(torch.int32).movedim(-1, dim).contiguous()


# ---- GPTQ --------------------------------------------------------------------------------------


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    bits: int = 4,
    group_size: int | None = None,
    sym: bool = True,
    zero_offset: int = 1,
) -> torch.Tensor:
    """GPTQ tensors (layout in the module docstring) -> float32 W[out_features, in_features].

    zero_offset: 1 for `checkpoint_format` "gptq" (v1, stores zero - 1), 0 for "gptq_v2"; see
    `gptq_zero_offset`. g_idx: the group of each input row; when None the groups are
    i // group_size, group_size defaulting to in_features / n_groups (-1: one group). qzeros may
    be None only for sym=True, meaning the symmetric zero 2^(bits-1) (what vLLM's gptq_marlin
    assumes for sym checkpoints; a sym checkpoint's stored qzeros decode to the same value).
    """
    return gptq_codes(qweight, qzeros, scales, g_idx, bits=bits, group_size=group_size,
                       sym=sym, zero_offset=zero_offset).dequantize()


def gptq_codes(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    bits: int = 4,
    group_size: int | None = None,
    sym: bool = True,
    zero_offset: int = 1,
) -> GroupedCodes:
    """GPTQ tensors -> their codes, zeros, scales and groups (arguments: `dequantize_gptq`),
    whose `int_weight()` is the integer form (with act-order, columns sorted by group)."""
    fmt = "gptq"
    _check_gptq(bits, zero_offset)
    _check_tensor(fmt, "qweight", qweight, "int32", 2)
    _check_tensor(fmt, "scales", scales, "float", 2)
    if qweight.shape[0] * 32 % bits:
        raise ValueError(
            f"{fmt} qweight: {qweight.shape[0]} rows of {bits}-bit values do not make whole "
            f"input rows (need a multiple of {bits // math.gcd(bits, 32)})"
        )
    in_features, out_features = qweight.shape[0] * 32 // bits, qweight.shape[1]
    n_groups = scales.shape[0]
    _check_shape(fmt, "scales", scales, (n_groups, out_features), "n_groups, out_features")
    if n_groups == 0:
        raise ValueError(f"{fmt} scales: has no groups")

    if g_idx is None:
        if group_size is None:
            if in_features % n_groups:
                raise ValueError(
                    f"{fmt} scales: n_groups={n_groups} does not divide in_features="
                    f"{in_features}; pass group_size or g_idx"
                )
            group_size = in_features // n_groups
        group_size = _resolve_group_size(fmt, in_features, group_size)
        if in_features // group_size != n_groups:
            raise ValueError(
                f"{fmt} scales: expected {in_features // group_size} groups (in_features="
                f"{in_features} / group_size={group_size}), got {n_groups}"
            )
        groups = torch.arange(in_features, device=qweight.device) // group_size
    else:
        _check_tensor(fmt, "g_idx", g_idx, "int", 1)
        _check_shape(fmt, "g_idx", g_idx, (in_features,), "in_features")
        _check_codes(fmt, "g_idx", g_idx, 0, n_groups - 1)
        groups = g_idx.to(device=qweight.device, dtype=torch.int64)

    if qzeros is None:
        if not sym:
            raise ValueError(f"{fmt} qzeros: required when sym=False")
        zeros = torch.full((n_groups, out_features), 1 << (bits - 1), device=qweight.device)
    else:
        _check_tensor(fmt, "qzeros", qzeros, "int32", 2)
        zero_words = _packed_len(fmt, "qzeros", out_features, bits, "out_features")
        _check_shape(
            fmt, "qzeros", qzeros, (n_groups, zero_words), "n_groups, out_features * bits / 32"
        )
        zeros = unpack_int32(qzeros, bits, dim=1) + zero_offset

    return GroupedCodes(unpack_int32(qweight, bits, dim=0), zeros.float(), scales.float(),
                        groups, bits)


def pack_gptq(
    codes: torch.Tensor,
    zeros: torch.Tensor | None,
    scales: torch.Tensor,
    *,
    bits: int = 4,
    zero_offset: int = 1,
    scales_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `dequantize_gptq`: codes [out, in] in [0, 2^bits), zeros [n_groups, out]
    (the true zero points; None: the symmetric 2^(bits-1)), scales [n_groups, out] ->
    (qweight, qzeros, scales as `scales_dtype`). zero_offset 1 (v1) stores zero - 1, so zeros
    must lie in [1, 2^bits]; 0 (v2) stores them as is, in [0, 2^bits - 1]. g_idx is not
    needed: the packed rows stay in input order whatever their groups."""
    fmt = "gptq"
    _check_gptq(bits, zero_offset)
    _check_tensor(fmt, "codes", codes, "int", 2)
    _check_tensor(fmt, "scales", scales, "float", 2)
    out_features, in_features = codes.shape
    _packed_len(fmt, "codes", in_features, bits, "in_features")
    _packed_len(fmt, "zeros", out_features, bits, "out_features")
    n_groups = scales.shape[0]
    _check_shape(fmt, "scales", scales, (n_groups, out_features), "n_groups, out_features")
    _check_codes(fmt, "codes", codes, 0, (1 << bits) - 1)
    if zeros is None:
        zeros = torch.full((n_groups, out_features), 1 << (bits - 1), device=codes.device)
    _check_tensor(fmt, "zeros", zeros, "int", 2)
    _check_shape(fmt, "zeros", zeros, (n_groups, out_features), "n_groups, out_features")
    _check_codes(fmt, "zeros", zeros, zero_offset, (1 << bits) - 1 + zero_offset)
    qweight = pack_int32(codes.t(), bits, dim=0)
    qzeros = pack_int32(zeros.to(torch.int64) - zero_offset, bits, dim=1)
    return qweight, qzeros, scales.to(scales_dtype).contiguous()


# ---- AWQ ---------------------------------------------------------------------------------------


def _awq_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Permute the last dim within runs of 8: result[..., 8w + j] = values[..., 8w + order[j]]."""
    idx = torch.tensor(order, device=values.device)
    return values.unflatten(-1, (-1, 8))[..., idx].flatten(-2)


def dequantize_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bits: int = 4,
) -> torch.Tensor:
    """AWQ GEMM tensors (layout in the module docstring) -> float32 W[out_features, in_features].
    group_size -1 means one group over all of in_features."""
    return awq_codes(qweight, qzeros, scales, group_size, bits).dequantize()


def awq_codes(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bits: int = 4,
) -> GroupedCodes:
    """AWQ GEMM tensors -> their codes, zeros, scales and groups (`int_weight()`: the integer
    form)."""
    fmt = "awq"
    _check_bits(fmt, bits, AWQ_BITS)
    _check_tensor(fmt, "qweight", qweight, "int32", 2)
    _check_tensor(fmt, "qzeros", qzeros, "int32", 2)
    _check_tensor(fmt, "scales", scales, "float", 2)
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 32 // bits
    group_size = _resolve_group_size(fmt, in_features, group_size)
    n_groups = in_features // group_size
    _check_shape(
        fmt,
        "qzeros",
        qzeros,
        (n_groups, qweight.shape[1]),
        "in_features / group_size, out_features * bits / 32",
    )
    _check_shape(
        fmt, "scales", scales, (n_groups, out_features), "in_features / group_size, out_features"
    )
    codes = _awq_columns(unpack_int32(qweight, bits, dim=1), AWQ_UNPACK_ORDER)  # [in, out]
    zeros = _awq_columns(unpack_int32(qzeros, bits, dim=1), AWQ_UNPACK_ORDER)
    groups = torch.arange(in_features, device=qweight.device) // group_size
    return GroupedCodes(codes, zeros.float(), scales.float(), groups, bits)


def pack_awq(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int = 4,
    scales_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `dequantize_awq`: codes [out, in] and zeros [in / group_size, out] in
    [0, 2^bits), scales [in / group_size, out] -> (qweight, qzeros, scales as `scales_dtype`)."""
    fmt = "awq"
    _check_bits(fmt, bits, AWQ_BITS)
    _check_tensor(fmt, "codes", codes, "int", 2)
    _check_tensor(fmt, "zeros", zeros, "int", 2)
    _check_tensor(fmt, "scales", scales, "float", 2)
    out_features, in_features = codes.shape
    _packed_len(fmt, "codes", out_features, bits, "out_features")
    n_groups = scales.shape[0]
    if n_groups == 0 or in_features % n_groups:
        raise ValueError(
            f"{fmt} scales: n_groups={n_groups} does not divide in_features={in_features}"
        )
    _check_shape(fmt, "scales", scales, (n_groups, out_features), "n_groups, out_features")
    _check_shape(fmt, "zeros", zeros, (n_groups, out_features), "n_groups, out_features")
    _check_codes(fmt, "codes", codes, 0, (1 << bits) - 1)
    _check_codes(fmt, "zeros", zeros, 0, (1 << bits) - 1)
    qweight = pack_int32(_awq_columns(codes.t(), AWQ_PACK_ORDER), bits, dim=1)
    qzeros = pack_int32(_awq_columns(zeros, AWQ_PACK_ORDER), bits, dim=1)
    return qweight, qzeros, scales.to(scales_dtype).contiguous()
