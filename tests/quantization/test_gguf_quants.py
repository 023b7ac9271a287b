"""aserve.quantization.gguf_quants against llama.cpp's own numpy reference (the `gguf` package).

Every supported type is dequantized from random valid blocks (random bytes, with the fp16 scale
fields set to finite values, so every bit of every quant field is exercised) and, where `gguf`
can quantize the type, from real quantized data; the result must equal
`gguf.quants.dequantize` bit for bit. Exact equality is the right tolerance: both sides turn the
fp16 scales and integer quants into float32 exactly and then do the same float32 multiplies and
adds in the same order (llama.cpp's `d * sc * q - dmin * m`), each rounded once, so any
difference is a layout bug, not rounding. Q8_K, which `gguf` cannot dequantize, is checked on a
hand-packed block.

A round trip (gguf quantize -> our dequantize) of smooth data must stay within half a
quantization step of each block's range, a bound that a misplaced value breaks (checked by
reversing each block).
"""

from __future__ import annotations

import gguf  # llama.cpp's own package: the reference
import numpy as np
import pytest
import torch

from aserve.quantization.gguf_quants import (
    BLOCK_SIZES,
    SUPPORTED,
    GGMLType,
    check_supported,
    dequantize,
    has_int_form,
    int_weight,
    nbytes,
)
from aserve.quantization.int_weights import IntWeight

Q = gguf.GGMLQuantizationType

FLOATS = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: None}
# Byte offsets of the fp16 scale fields in a block (the other bytes are free quant bits).
FP16_FIELDS = {
    GGMLType.Q8_0: [0],
    GGMLType.Q4_0: [0],
    GGMLType.Q4_1: [0, 2],
    GGMLType.Q5_0: [0],
    GGMLType.Q5_1: [0, 2],
    GGMLType.Q2_K: [80, 82],
    GGMLType.Q3_K: [108],
    GGMLType.Q4_K: [0, 2],
    GGMLType.Q5_K: [0, 2],
    GGMLType.Q6_K: [208],
}
WITH_GGUF_REFERENCE = sorted(FLOATS.keys() | FP16_FIELDS.keys())  # all but Q8_K
GGUF_QUANTIZES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
                  GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]


def shapes_for(qtype: GGMLType) -> list[tuple[int, ...]]:
    bs = max(BLOCK_SIZES[qtype][0], 32)
    return [(1, bs), (7, 4 * bs), (2, 3, 2 * bs)]


def random_raw(qtype: GGMLType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid bytes of a `qtype` tensor of `shape`, as (*shape[:-1], bytes per row) uint8."""
    block_size, type_size = BLOCK_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    n_blocks = rows * shape[-1] // block_size
    if qtype in FLOATS:
        x = rng.standard_normal(shape).astype(np.float32)
        raw = gguf.quants.quantize(x, Q(qtype)).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for offset in FP16_FIELDS[qtype]:
            scale = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
            raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], -1)


def reference(raw: np.ndarray, qtype: GGMLType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, Q(qtype))))


def ours(raw: np.ndarray, qtype, shape) -> torch.Tensor:
    return dequantize(torch.from_numpy(raw.reshape(-1).copy()), qtype, shape)


def test_type_ids_and_block_sizes_are_llama_cpps():
    for t in GGMLType:
        assert Q[t.name].value == t.value, t
    for t, sizes in BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[Q(t)] == sizes, t
    assert len(SUPPORTED) == 14


@pytest.mark.parametrize("qtype", WITH_GGUF_REFERENCE, ids=lambda t: t.name)
def test_random_blocks_match_gguf_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    for shape in shapes_for(qtype):
        raw = random_raw(qtype, shape, rng)
        out = ours(raw, qtype, shape)
        assert out.dtype == torch.float32 and out.shape == shape
        torch.testing.assert_close(out, reference(raw, qtype).reshape(shape), rtol=0, atol=0)


def smooth(rows: int, cols: int) -> np.ndarray:
    """Rows of slow sines with different amplitudes and offsets (one with a large offset, for
    the types with a min)."""
    t = np.arange(cols, dtype=np.float32)
    amp = np.geomspace(1e-3, 10.0, rows, dtype=np.float32)[:, None]
    offset = np.linspace(-2.0, 2.0, rows, dtype=np.float32)[:, None]
    return (amp * np.sin(t / 11.0 + np.arange(rows)[:, None]) + offset * amp).astype(np.float32)


def step_bound(qtype: GGMLType, x_blocks: np.ndarray) -> np.ndarray:
    """Largest error a correct dequantization may show per element, from each block's range: half
    a step (a whole one for Q4_0/Q5_0, whose scale maps the block's signed extreme to -8 / -16 so
    that values near the opposite extreme clip to +7 / +15), plus slack for the fp16 rounding of
    the scale (relative 2^-11 times the largest q)."""
    amax = np.abs(x_blocks).max(axis=-1, keepdims=True)
    span = x_blocks.max(axis=-1, keepdims=True) - x_blocks.min(axis=-1, keepdims=True)
    step = {
        GGMLType.Q8_0: amax / 254, GGMLType.Q4_0: amax / 8, GGMLType.Q5_0: amax / 16,
        GGMLType.Q4_1: span / 30, GGMLType.Q5_1: span / 62,
    }
    if qtype in step:
        return step[qtype] + 2.0**-10 * (amax + span)
    rel = {GGMLType.F32: 0.0, GGMLType.F16: 2.0**-11, GGMLType.BF16: 2.0**-8}[qtype]
    return rel * np.abs(x_blocks)


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES, ids=lambda t: t.name)
def test_quantize_round_trip(qtype):
    rows, cols = 6, 1024
    x = smooth(rows, cols)
    raw = gguf.quants.quantize(x, Q(qtype)).view(np.uint8)
    assert raw.shape == (rows, nbytes(qtype, (rows, cols)) // rows)
    out = ours(raw, qtype, (rows, cols))
    torch.testing.assert_close(out, reference(raw, qtype), rtol=0, atol=0)

    block = BLOCK_SIZES[qtype][0] if qtype not in FLOATS else 32
    xb = x.reshape(-1, block)
    bound = step_bound(qtype, xb)
    err = np.abs(out.numpy().reshape(-1, block) - xb)
    assert (err <= bound).all(), (err - bound).max()
    if qtype not in FLOATS:  # values in the wrong place inside a block break the bound
        wrong = np.abs(out.numpy().reshape(-1, block)[:, ::-1] - xb)
        assert (wrong > bound).any(axis=-1).mean() > 0.9


def test_q8_k_hand_packed():
    rng = np.random.default_rng(0)
    d = np.array([0.25, -3.0e-3], dtype=np.float32)
    q = rng.integers(-128, 128, size=(2, 256), dtype=np.int8)
    bsums = q.reshape(2, 16, 16).astype(np.int16).sum(-1).astype(np.int16)
    raw = np.concatenate([d.view(np.uint8).reshape(2, 4), q.view(np.uint8),
                          bsums.view(np.uint8).reshape(2, 32)], axis=1)
    assert raw.shape == (2, BLOCK_SIZES[GGMLType.Q8_K][1])
    out = ours(raw, GGMLType.Q8_K, (1, 512))
    torch.testing.assert_close(out, torch.from_numpy(q.astype(np.float32) * d[:, None])
                               .reshape(1, 512), rtol=0, atol=0)


def test_q4_k_scales_high_bits_hand_packed():
    """One Q4_K block built from the C reference's description, with 6-bit scales and mins
    >= 16 so that the high 2 bits (stored in the top of bytes 0-7) matter."""
    sc = np.array([1, 17, 33, 63, 5, 21, 47, 60], dtype=np.uint8)
    mn = np.array([0, 16, 40, 63, 9, 30, 50, 2], dtype=np.uint8)
    packed = np.zeros(12, dtype=np.uint8)
    packed[0:4] = (sc[:4] & 63) | ((sc[4:] >> 4) << 6)
    packed[4:8] = (mn[:4] & 63) | ((mn[4:] >> 4) << 6)
    packed[8:12] = (sc[4:] & 15) | ((mn[4:] & 15) << 4)
    q = np.arange(256, dtype=np.uint8) % 16  # value i of sub-block s, s in 0..7
    q = (q * 7 + np.arange(256) // 32) % 16
    nib = q.reshape(4, 2, 32)  # run j: sub-block 2j in the low nibble, 2j + 1 in the high
    qs = (nib[:, 0] | (nib[:, 1] << 4)).astype(np.uint8).reshape(-1)
    d, dmin = np.float16(0.5), np.float16(0.25)
    raw = np.concatenate([np.array([d, dmin], dtype=np.float16).view(np.uint8), packed, qs])
    expected = (np.float32(d) * sc.repeat(32) * q - np.float32(dmin) * mn.repeat(32))
    out = ours(raw, GGMLType.Q4_K, (256,))
    torch.testing.assert_close(out, torch.from_numpy(expected.astype(np.float32)),
                               rtol=0, atol=0)


def test_qtype_forms_and_unaligned_bytes():
    rng = np.random.default_rng(1)
    shape = (3, 512)
    raw = random_raw(GGMLType.Q6_K, shape, rng).reshape(-1)
    want = ours(raw, GGMLType.Q6_K, shape)
    for form in (Q.Q6_K, int(GGMLType.Q6_K), "Q6_K", "q6_k"):
        assert torch.equal(ours(raw, form, shape), want)
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(raw)  # storage offset 1: fp16 fields are misaligned
    assert torch.equal(dequantize(buffer[1:], GGMLType.Q6_K, shape), want)
    f32 = torch.zeros(4 * 64 + 1, dtype=torch.uint8)
    f32[1:] = torch.arange(64, dtype=torch.float32).view(torch.uint8)
    assert torch.equal(dequantize(f32[1:], "F32", (8, 8)), torch.arange(64.0).reshape(8, 8))


def test_wrong_sizes_raise_naming_the_type_and_sizes():
    raw = torch.zeros(nbytes(GGMLType.Q4_K, (4, 256)), dtype=torch.uint8)
    assert raw.numel() == 4 * 144
    with pytest.raises(ValueError, match=r"Q4_K tensor 'blk.0.w' of shape \(4, 512\) "
                                         r"needs 1152 bytes, got 576"):
        dequantize(raw, GGMLType.Q4_K, (4, 512), name="blk.0.w")
    with pytest.raises(ValueError, match=r"Q8_0: a row of 48 values .* 32-value blocks"):
        dequantize(torch.zeros(34 * 3, dtype=torch.uint8), GGMLType.Q8_0, (2, 48))
    with pytest.raises(ValueError, match=r"Q8_0 tensor 'w': expected raw uint8 bytes"):
        dequantize(torch.zeros(34, dtype=torch.int8), GGMLType.Q8_0, (32,), name="w")


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_NL, Q.TQ1_0, Q.MXFP4, Q.Q8_1, Q.I8, 99,
                                   "IQ4_XS"], ids=str)
def test_unsupported_types_raise_naming_the_tensor(qtype):
    name = getattr(qtype, "name", None) or (qtype if isinstance(qtype, str) else "type id 99")
    with pytest.raises(ValueError, match=rf"tensor 'blk.3.ffn_down.weight' has GGML quant type "
                                         rf"{name}, which aserve cannot dequantize"):
        check_supported(qtype, "blk.3.ffn_down.weight")
    with pytest.raises(ValueError, match=r"'blk.3.ffn_down.weight'"):
        dequantize(torch.zeros(64, dtype=torch.uint8), qtype, (32,), name="blk.3.ffn_down.weight")


VALUE_BITS = {GGMLType.Q8_0: 8, GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q5_0: 5,
              GGMLType.Q5_1: 5, GGMLType.Q2_K: 2, GGMLType.Q3_K: 3, GGMLType.Q4_K: 4,
              GGMLType.Q5_K: 5, GGMLType.Q6_K: 6}


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS), ids=lambda t: t.name)
def test_the_integer_form_is_the_dequantized_weight(qtype):
    """scale * q + min per group equals llama.cpp's dequantization (float32 rounding aside:
    Q6_K's scale * q may take 25 bits), with q in the type's bits and groups of its
    (sub-)blocks, so the integer kernels compute on the file's own numbers."""
    rng = np.random.default_rng(100 + int(qtype))
    shape = (5, 2 * max(BLOCK_SIZES[qtype][0], 32))
    raw = random_raw(qtype, shape, rng)
    weight = int_weight(torch.from_numpy(raw.reshape(-1).copy()), qtype, shape)
    assert has_int_form(qtype) and weight.bits == VALUE_BITS[qtype]
    assert weight.group == (16 if qtype in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q6_K) else 32)
    assert weight.q.dtype == torch.uint8 and int(weight.q.max()) < 2 ** weight.bits
    assert int(weight.q.max()) == 2 ** weight.bits - 1  # every bit of the values is read
    expected = reference(raw, qtype).reshape(shape)
    torch.testing.assert_close(weight.dequantize(), expected, rtol=2 ** -23, atol=0)


K_QUANTS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_say_their_two_levels(qtype):
    """A K-quant's integer form carries its blocks' fp16 scale (and min) and its groups' small
    integer sub-scales (and sub-mins), whose products are the form's scale and min exactly:
    what the kernel packs instead of an fp16 pair a group."""
    shape = (3, 512)
    raw = random_raw(qtype, shape, np.random.default_rng(200 + int(qtype)))
    weight = int_weight(torch.from_numpy(raw.reshape(-1).copy()), qtype, shape)
    blocks = weight.blocks
    assert blocks is not None and blocks.scale.shape == (3, 2)
    assert blocks.sub_scale.dtype == torch.int8 and blocks.sub_scale.shape == weight.scale.shape
    per_group = 256 // weight.group
    assert torch.equal(torch.repeat_interleave(blocks.scale, per_group, dim=1)
                       * blocks.sub_scale.float(), weight.scale)
    assert torch.equal(blocks.scale.half().float(), blocks.scale)  # fp16 values
    symmetric = qtype in (GGMLType.Q3_K, GGMLType.Q6_K)  # (min = -4 or -32 times the scale)
    assert (blocks.sub_min is None) == symmetric == (blocks.min is None)
    if not symmetric:
        assert torch.equal(torch.repeat_interleave(blocks.min, per_group, dim=1)
                           * blocks.sub_min.float(), weight.min)
    rows = weight.rows(torch.tensor([2, 0]))
    assert torch.equal(rows.blocks.sub_scale, blocks.sub_scale[[2, 0]])


def test_float_types_have_no_integer_form():
    for qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_K):
        assert not has_int_form(qtype)
        raw = random_raw(qtype, (2, 256), np.random.default_rng(0)) if qtype in FLOATS else \
            np.zeros((2, 292), np.uint8)
        assert int_weight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (2, 256)) is None


def test_parts_of_mixed_types_stack_in_the_finest_group_and_most_bits():
    """Q4_K_M puts Q6_K beside Q4_K in one layer: q (Q4_K, groups of 32, 4 bits) and v (Q6_K,
    groups of 16, 6 bits) stack as one weight of groups of 16 and 6 bits, values unchanged."""
    rng = np.random.default_rng(7)
    parts = []
    for qtype, rows in ((GGMLType.Q4_K, 3), (GGMLType.Q6_K, 2)):
        raw = random_raw(qtype, (rows, 512), rng)
        parts.append(int_weight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (rows, 512)))
    both = IntWeight.concat(parts)
    assert (both.group, both.bits, tuple(both.shape)) == (16, 6, (5, 512))
    # Q6_K's symmetric groups beside Q4_K's mins: its mins stored too, -32 d times its scales
    assert torch.equal(both.blocks.sub_min[3:], both.blocks.sub_scale[3:])
    assert torch.equal(both.regroup(16).min, both.min)
    rebuilt = torch.repeat_interleave(both.blocks.min, 16, dim=1) * both.blocks.sub_min.float()
    assert torch.equal(rebuilt, both.min)
    twice = IntWeight.concat([parts[0], parts[0]])  # (one type: its two levels stack)
    assert torch.equal(twice.blocks.sub_min, torch.cat([parts[0].blocks.sub_min] * 2))
    assert parts[0].regroup(16).blocks.sub_scale.shape == (3, 32)
    torch.testing.assert_close(both.dequantize(),
                               torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="columns"):
        IntWeight.concat([parts[0], IntWeight(parts[1].q[:, :256], parts[1].scale[:, :16],
                                              parts[1].min[:, :16], 16, 6)])
