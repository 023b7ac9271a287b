"""aserve.quantization.awq_gptq: AWQ / GPTQ checkpoint tensors dequantized to float32 W[out, in].

The layouts are checked three independent ways:

- hand-packed words with known values (AWQ's interleaved nibble order (0, 2, 4, 6, 1, 3, 5, 7)
  as AutoAWQ's `WQLinear_GEMM.from_linear` packs it; GPTQ's low-bits-first rows, the 3-bit
  stream where rows 10 and 21 straddle words; GPTQ v1's stored zero - 1, e.g. the 0x77777777
  qzeros of every symmetric 4-bit v1 checkpoint), so a wrong order or offset fails;
- `pack_*` output read back by a bit-by-bit reader written here from the documented layout;
- random codes / zeros / scales -> pack -> dequantize equal to the direct formula
  (q - z) * s, evaluated element by element with explicit loops, for GPTQ bits 2/3/4/8, v1 and
  v2 zeros, sorted and act-order g_idx, and AWQ.

Exact equality is the right tolerance: (q - z) is a small integer and s an fp16 value, so the
product is exact in float32 whichever way it is computed.
"""

from __future__ import annotations

import pytest
import torch

from aserve.quantization.awq_gptq import (
    dequantize_awq,
    dequantize_gptq,
    gptq_zero_offset,
    pack_awq,
    pack_gptq,
)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm.py: nibble k holds column AWQ_ORDER[k]


def i32(word: int) -> int:
    """An unsigned 32-bit word as the int32 a checkpoint stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


def u32(x) -> int:
    return int(x) & 0xFFFFFFFF


def stream_value(words: list[int], v: int, bits: int) -> int:
    """Value v of a little-endian bit stream over `words`, assembled bit by bit."""
    out = 0
    for b in range(bits):
        pos = v * bits + b
        out |= ((u32(words[pos // 32]) >> (pos % 32)) & 1) << b
    return out


def ref_gptq_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """[in * bits / 32, out] packed down each column -> codes [out, in]."""
    n_words, out_f = qweight.shape
    in_f = n_words * 32 // bits
    cols = qweight.t().tolist()
    return torch.tensor(
        [[stream_value(cols[o], i, bits) for i in range(in_f)] for o in range(out_f)]
    )


def ref_gptq_zeros(qzeros: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """[n_groups, out * bits / 32] packed along each row -> zeros [n_groups, out]."""
    rows = qzeros.tolist()
    out_f = qzeros.shape[1] * 32 // bits
    return torch.tensor(
        [[stream_value(r, o, bits) + zero_offset for o in range(out_f)] for r in rows]
    )


def ref_awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[rows, out / 8] -> [rows, out]: nibble k of word w is column 8w + AWQ_ORDER[k]."""
    rows = packed.tolist()
    out = [[0] * (len(r) * 8) for r in rows]
    for i, r in enumerate(rows):
        for w, word in enumerate(r):
            for k in range(8):
                out[i][8 * w + AWQ_ORDER[k]] = (u32(word) >> (4 * k)) & 0xF
    return torch.tensor(out)


def direct(codes, zeros, scales, groups) -> torch.Tensor:
    """W[o, i] = (codes[o, i] - zeros[g, o]) * scales[g, o] with g = groups[i], one at a time."""
    out_f, in_f = codes.shape
    c, z, s, g = codes.tolist(), zeros.tolist(), scales.float().tolist(), list(groups)
    w = [[(c[o][i] - z[g[i]][o]) * s[g[i]][o] for i in range(in_f)] for o in range(out_f)]
    return torch.tensor(w, dtype=torch.float32)


def random_scales(n_groups: int, out_f: int, gen: torch.Generator) -> torch.Tensor:
    return ((torch.rand(n_groups, out_f, generator=gen) - 0.5) * 0.2).half()


def act_order_g_idx(in_f: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """Rows quantized in a random order; the k-th quantized row is in group k // group_size."""
    perm = torch.randperm(in_f, generator=gen)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // group_size).to(torch.int32)
    return g_idx


# ---- GPTQ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("shape", [(32, 64, 16), (64, 96, 32), (32, 32, -1)])
def test_gptq_roundtrip(bits, fmt, act_order, shape):
    out_f, in_f, group_size = shape
    gs = in_f if group_size == -1 else group_size
    n_groups = in_f // gs
    off = gptq_zero_offset(fmt)
    gen = torch.Generator().manual_seed(bits * 100 + off * 10 + act_order + in_f)
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen)
    zeros = torch.randint(off, (1 << bits) + off, (n_groups, out_f), generator=gen)
    scales = random_scales(n_groups, out_f, gen)

    qweight, qzeros, s16 = pack_gptq(codes, zeros, scales, bits=bits, zero_offset=off)
    assert qweight.dtype == qzeros.dtype == torch.int32 and s16.dtype == torch.float16
    assert qweight.shape == (in_f * bits // 32, out_f)
    assert qzeros.shape == (n_groups, out_f * bits // 32)
    assert torch.equal(ref_gptq_codes(qweight, bits), codes)
    assert torch.equal(ref_gptq_zeros(qzeros, bits, off), zeros)

    if act_order and n_groups > 1:
        g_idx = act_order_g_idx(in_f, gs, gen)
        assert not bool((g_idx[1:] >= g_idx[:-1]).all())  # really unsorted
        w = dequantize_gptq(qweight, qzeros, s16, g_idx, bits=bits, zero_offset=off)
        groups = g_idx.tolist()
        assert not torch.equal(  # the permutation matters
            w, dequantize_gptq(qweight, qzeros, s16, bits=bits, zero_offset=off)
        )
    else:
        groups = [i // gs for i in range(in_f)]
        w = dequantize_gptq(qweight, qzeros, s16, bits=bits, zero_offset=off)
        g_idx = torch.tensor(groups, dtype=torch.int32)
        assert torch.equal(
            w, dequantize_gptq(qweight, qzeros, s16, g_idx, bits=bits, zero_offset=off)
        )
        w_gs = dequantize_gptq(
            qweight, qzeros, s16, bits=bits, group_size=group_size, zero_offset=off
        )
        assert torch.equal(w, w_gs)
    assert w.dtype == torch.float32 and w.shape == (out_f, in_f)
    assert torch.equal(w, direct(codes, zeros, s16, groups))


def test_gptq_hand_packed_4bit_rows_low_nibble_first():
    # Column words 0x76543210, 0xFEDCBA98 (a negative int32) hold rows 0..15 = codes 0..15.
    qweight = torch.tensor([[0x76543210] * 8, [i32(0xFEDCBA98)] * 8], dtype=torch.int32)
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)  # symmetric v1: 7 stored, zero 8
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    rows = torch.arange(16, dtype=torch.float32)
    w = dequantize_gptq(qweight, qzeros, scales, bits=4, zero_offset=1)
    assert torch.equal(w, ((rows - 8) * 0.5).expand(8, 16))
    w2 = dequantize_gptq(qweight, qzeros, scales, bits=4, zero_offset=0)  # gptq_v2 reads 7
    assert torch.equal(w2, ((rows - 7) * 0.5).expand(8, 16))
    w_sym = dequantize_gptq(qweight, None, scales, bits=4, sym=True)  # implicit zero 2^(bits-1)
    assert torch.equal(w_sym, w)
    # and the packer writes exactly these words
    codes = torch.arange(16).expand(8, 16)
    qw, qz, _ = pack_gptq(codes, None, scales.float(), bits=4, zero_offset=1)
    assert torch.equal(qw, qweight) and torch.equal(qz, qzeros)


def test_gptq_v1_zero_plus_one():
    # qzeros nibbles (low first) 1, 2, 0, 0, 0, 0, 0, 15: v1 zeros 2, 3, 1, 1, 1, 1, 1, 16.
    word = i32(0xF0000021)
    qzeros = torch.tensor([[word]], dtype=torch.int32)
    qweight = torch.zeros((1, 8), dtype=torch.int32)  # 8 input rows, all codes 0
    scales = torch.ones((1, 8), dtype=torch.float16)
    v1 = torch.tensor([2, 3, 1, 1, 1, 1, 1, 16])
    v2 = torch.tensor([1, 2, 0, 0, 0, 0, 0, 15])
    w1 = dequantize_gptq(qweight, qzeros, scales, bits=4, zero_offset=gptq_zero_offset("gptq"))
    w2 = dequantize_gptq(qweight, qzeros, scales, bits=4, zero_offset=gptq_zero_offset("gptq_v2"))
    assert torch.equal(w1, -v1.float()[:, None].expand(8, 8))
    assert torch.equal(w2, -v2.float()[:, None].expand(8, 8))
    codes = torch.zeros((8, 8), dtype=torch.int64)
    _, qz1, _ = pack_gptq(codes, v1[None], scales.float(), bits=4, zero_offset=1)
    _, qz2, _ = pack_gptq(codes, v2[None], scales.float(), bits=4, zero_offset=0)
    assert qz1.tolist() == qz2.tolist() == [[word]]


def test_gptq_hand_packed_8bit():
    # Rows 0..3 = 1, 2, 3, 4; rows 4..7 = 0x7F, 0xFE, 0x80, 0xFF; symmetric v1 zeros 0x7F + 1.
    qweight = torch.tensor([[0x04030201] * 4, [i32(0xFF80FE7F)] * 4], dtype=torch.int32)
    qzeros = torch.tensor([[0x7F7F7F7F]], dtype=torch.int32)
    scales = torch.full((1, 4), 2.0, dtype=torch.float16)
    rows = torch.tensor([1, 2, 3, 4, 127, 254, 128, 255], dtype=torch.float32)
    w = dequantize_gptq(qweight, qzeros, scales, bits=8)
    assert torch.equal(w, ((rows - 128) * 2).expand(4, 8))


def test_gptq_hand_packed_3bit_straddling_rows():
    # 32 rows in 3 words: row 0 = 7 at bits 0-2; row 10 = 5 (0b101) with bits 30-31 of word 0
    # (0b01) and bit 0 of word 1 (0b1); row 21 = 6 (0b110) with bit 31 of word 1 (0) and bits 0-1
    # of word 2 (0b11); row 31 = 3 at bits 29-31 of word 2.
    words = [7 | (1 << 30), 1, 0b11 | (3 << 29)]
    qweight = torch.tensor([[i32(x)] * 32 for x in words], dtype=torch.int32)
    qzeros = torch.zeros((1, 3), dtype=torch.int32)
    scales = torch.ones((1, 32), dtype=torch.float16)
    expected = torch.zeros(32)
    expected[[0, 10, 21, 31]] = torch.tensor([7.0, 5.0, 6.0, 3.0])
    w = dequantize_gptq(qweight, qzeros, scales, bits=3, zero_offset=0)
    assert torch.equal(w, expected.expand(32, 32))
    qw, _, _ = pack_gptq(
        expected.long().expand(32, 32),
        torch.zeros((1, 32), dtype=torch.int64),
        scales.float(),
        bits=3,
        zero_offset=0,
    )
    assert torch.equal(qw, qweight)


def test_gptq_scale_dtypes_and_output():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 32), generator=gen)
    zeros = torch.randint(1, 17, (2, 16), generator=gen)
    scales = random_scales(2, 16, gen)
    qw, qz, s16 = pack_gptq(codes, zeros, scales)
    ref = dequantize_gptq(qw, qz, s16)
    assert torch.equal(dequantize_gptq(qw, qz, s16.float()), ref)
    assert dequantize_gptq(qw, qz, s16.bfloat16()).dtype == torch.float32


def test_gptq_zero_offset_names():
    assert gptq_zero_offset(None) == 1
    assert gptq_zero_offset("gptq") == 1
    assert gptq_zero_offset("gptq_v2") == 0
    with pytest.raises(ValueError, match="checkpoint_format 'awq'"):
        gptq_zero_offset("awq")


# ---- AWQ -----------------------------------------------------------------------------------------


def test_awq_hand_packed_nibble_order():
    # Columns 1..8 packed AutoAWQ's way: nibbles (low first) hold columns 0, 2, 4, 6, 1, 3, 5, 7.
    word = i32(0x86427531)
    qweight = torch.tensor([[word]], dtype=torch.int32)  # in_features 1, out_features 8
    qzeros = torch.zeros((1, 1), dtype=torch.int32)
    scales = torch.ones((1, 8), dtype=torch.float16)
    w = dequantize_awq(qweight, qzeros, scales, group_size=1)
    assert w[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    # A word written in plain nibble order reads back interleaved.
    plain = torch.tensor([[0x76543210]], dtype=torch.int32)
    w_plain = dequantize_awq(plain, qzeros, scales, group_size=1)
    assert w_plain[:, 0].tolist() == [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    # Zeros use the same order and no offset.
    w_z = dequantize_awq(torch.zeros((1, 1), dtype=torch.int32), qweight, scales, group_size=1)
    assert w_z[:, 0].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    # The packer writes that word.
    qw, qz, _ = pack_awq(torch.arange(1, 9)[:, None], torch.arange(1, 9)[None], scales.float())
    assert qw.tolist() == qz.tolist() == [[word]]


@pytest.mark.parametrize("shape", [(16, 64, 16), (32, 32, -1), (64, 128, 32), (8, 24, 8)])
def test_awq_roundtrip(shape):
    out_f, in_f, group_size = shape
    gs = in_f if group_size == -1 else group_size
    n_groups = in_f // gs
    gen = torch.Generator().manual_seed(out_f + in_f)
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen)
    zeros = torch.randint(0, 16, (n_groups, out_f), generator=gen)
    scales = random_scales(n_groups, out_f, gen)
    qweight, qzeros, s16 = pack_awq(codes, zeros, scales)
    assert qweight.dtype == qzeros.dtype == torch.int32 and s16.dtype == torch.float16
    assert qweight.shape == (in_f, out_f // 8) and qzeros.shape == (n_groups, out_f // 8)
    assert torch.equal(ref_awq_unpack(qweight), codes.t())
    assert torch.equal(ref_awq_unpack(qzeros), zeros)
    w = dequantize_awq(qweight, qzeros, s16, group_size)
    assert w.dtype == torch.float32 and w.shape == (out_f, in_f)
    assert torch.equal(w, direct(codes, zeros, s16, [i // gs for i in range(in_f)]))


# ---- validation ----------------------------------------------------------------------------------


def _gptq_args(out_f=16, in_f=32, n_groups=2, bits=4):
    qweight = torch.zeros((in_f * bits // 32, out_f), dtype=torch.int32)
    qzeros = torch.zeros((n_groups, out_f * bits // 32), dtype=torch.int32)
    scales = torch.ones((n_groups, out_f), dtype=torch.float16)
    return qweight, qzeros, scales


def _awq_args(out_f=16, in_f=32, n_groups=2):
    qweight = torch.zeros((in_f, out_f // 8), dtype=torch.int32)
    qzeros = torch.zeros((n_groups, out_f // 8), dtype=torch.int32)
    scales = torch.ones((n_groups, out_f), dtype=torch.float16)
    return qweight, qzeros, scales


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


BAD = {
    "gptq bits 5": (lambda: dequantize_gptq(*_gptq_args(), bits=5), r"gptq: bits=5"),
    "gptq bits 16": (lambda: dequantize_gptq(*_gptq_args(), bits=16), r"bits=16"),
    "awq bits 8": (lambda: dequantize_awq(*_awq_args(), 16, bits=8), r"awq: bits=8"),
    "gptq qweight float": (
        lambda: dequantize_gptq(*_replace(_gptq_args(), 0, torch.zeros(4, 16))),
        r"gptq qweight: expected dtype torch.int32",
    ),
    "gptq qweight 1-d": (
        lambda: dequantize_gptq(*_replace(_gptq_args(), 0, torch.zeros(4, dtype=torch.int32))),
        r"gptq qweight: expected 2 dims",
    ),
    "gptq 3-bit rows": (
        lambda: dequantize_gptq(
            *_replace(
                _gptq_args(bits=3, in_f=32, out_f=32), 0, torch.zeros((4, 32), dtype=torch.int32)
            ),
            bits=3,
        ),
        r"gptq qweight: 4 rows",
    ),
    "gptq scales shape": (
        lambda: dequantize_gptq(*_replace(_gptq_args(), 2, torch.ones((2, 8)).half())),
        r"gptq scales: expected shape \(2, 16\)",
    ),
    "gptq scales int": (
        lambda: dequantize_gptq(*_replace(_gptq_args(), 2, torch.ones((2, 16), dtype=torch.int32))),
        r"gptq scales: expected a floating dtype",
    ),
    "gptq qzeros shape": (
        lambda: dequantize_gptq(*_replace(_gptq_args(), 1, torch.zeros((2, 3), dtype=torch.int32))),
        r"gptq qzeros: expected shape \(2, 2\)",
    ),
    "gptq qzeros unpackable out": (
        lambda: dequantize_gptq(*_gptq_args(out_f=12)),
        r"gptq qzeros: out_features=12 must be a multiple of 8",
    ),
    "gptq g_idx length": (
        lambda: dequantize_gptq(*_gptq_args(), torch.zeros(31, dtype=torch.int32)),
        r"gptq g_idx: expected shape \(32,\)",
    ),
    "gptq g_idx range": (
        lambda: dequantize_gptq(*_gptq_args(), torch.full((32,), 2, dtype=torch.int32)),
        r"gptq g_idx: values must lie in \[0, 1\]",
    ),
    "gptq g_idx float": (
        lambda: dequantize_gptq(*_gptq_args(), torch.zeros(32)),
        r"gptq g_idx: expected an integer dtype",
    ),
    "gptq group_size not dividing": (
        lambda: dequantize_gptq(*_gptq_args(), group_size=24),
        r"gptq: group_size=24 does not divide in_features=32",
    ),
    "gptq group_size vs groups": (
        lambda: dequantize_gptq(*_gptq_args(), group_size=8),
        r"gptq scales: expected 4 groups",
    ),
    "gptq n_groups not dividing": (
        lambda: dequantize_gptq(*_gptq_args(n_groups=3)),
        r"gptq scales: n_groups=3 does not divide in_features=32",
    ),
    "gptq asym without qzeros": (
        lambda: dequantize_gptq(*_replace(_gptq_args(), 1, None), sym=False),
        r"gptq qzeros: required when sym=False",
    ),
    "gptq zero_offset 2": (
        lambda: dequantize_gptq(*_gptq_args(), zero_offset=2),
        r"zero_offset=2",
    ),
    "awq group_size not dividing": (
        lambda: dequantize_awq(*_awq_args(), 24),
        r"awq: group_size=24 does not divide in_features=32",
    ),
    "awq group_size zero": (lambda: dequantize_awq(*_awq_args(), 0), r"group_size=0"),
    "awq qzeros shape": (
        lambda: dequantize_awq(*_awq_args(), 8),
        r"awq qzeros: expected shape \(4, 2\)",
    ),
    "awq scales shape": (
        lambda: dequantize_awq(*_replace(_awq_args(), 2, torch.ones((2, 8)).half()), 16),
        r"awq scales: expected shape \(2, 16\)",
    ),
    "awq qzeros dtype": (
        lambda: dequantize_awq(*_replace(_awq_args(), 1, torch.zeros((2, 2))), 16),
        r"awq qzeros: expected dtype torch.int32",
    ),
    "pack_gptq v1 zero 0": (
        lambda: pack_gptq(
            torch.zeros((8, 8), dtype=torch.int64),
            torch.zeros((1, 8), dtype=torch.int64),
            torch.ones((1, 8)),
            zero_offset=1,
        ),
        r"gptq zeros: values must lie in \[1, 16\]",
    ),
    "pack_gptq code 16": (
        lambda: pack_gptq(torch.full((8, 8), 16), None, torch.ones((1, 8))),
        r"gptq codes: values must lie in \[0, 15\]",
    ),
    "pack_gptq in not packable": (
        lambda: pack_gptq(torch.zeros((8, 12), dtype=torch.int64), None, torch.ones((1, 8))),
        r"gptq codes: in_features=12",
    ),
    "pack_awq out not packable": (
        lambda: pack_awq(
            torch.zeros((12, 8), dtype=torch.int64),
            torch.zeros((1, 12), dtype=torch.int64),
            torch.ones((1, 12)),
        ),
        r"awq codes: out_features=12",
    ),
    "pack_awq zeros shape": (
        lambda: pack_awq(
            torch.zeros((8, 8), dtype=torch.int64),
            torch.zeros((2, 8), dtype=torch.int64),
            torch.ones((1, 8)),
        ),
        r"awq zeros: expected shape \(1, 8\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_value_error(case):
    call, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        call()
