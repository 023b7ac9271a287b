"""The VNNI int4 / int8 weight-only GEMM (`kernels/cpu_qgemm.py`, `csrc/qgemm.h`) against its
torch twin `cpu_qgemm.reference`: the packing round-trips, every epilogue (plain with bias,
float, gated split and SiLU) agrees to the output's one bf16 rounding, across bits, groups,
row counts that cross the 4-row tile and the 64-row block, and widths that leave a panel
partly empty; the twin itself is the float product up to int8 activation error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import cpu_qgemm
from aserve.kernels.cpu_qgemm import QuantPackedWeight, quantize_activations, reference
from aserve.quantization.int_weights import IntWeight, SuperBlocks

pytestmark = pytest.mark.skipif(not cpu_qgemm.available(),
                                reason="the CPU or build lacks AVX512-VNNI and AVX2")


def int_weight(rows: int, cols: int, group: int, bits: int, seed: int = 0) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // group, generator=g) * 0.02 + 0.001
    low = -torch.rand(rows, cols // group, generator=g) * 2 ** bits * 0.01
    return IntWeight(q, scale, low, group, bits)


def fp16_rounded(w: IntWeight) -> IntWeight:
    return IntWeight(w.q, w.scale.half().float(), w.min.half().float(), w.group, w.bits)


def assert_bf16_of(y: torch.Tensor, exact: torch.Tensor) -> None:
    """y (bf16) is `exact` (float32) rounded once to bf16, give or take one bf16 step where
    fused and separate roundings of the float sums part."""
    step = exact.abs().clamp_min(1e-3) * 2 ** -7
    assert ((y.float() - exact).abs() <= step).all(), (y.float() - exact).abs().max()
    close = (y.float() == exact.bfloat16().float()).float().mean()
    assert close > 0.95, close  # most bit-equal


CASES = [  # rows, cols, group, bits (of a value), M (5, 6 bits past 32: unpacked to bytes)
    (96, 64, 32, 4, 1), (100, 128, 32, 8, 5), (49, 256, 16, 4, 3), (50, 256, 128, 6, 70),
    (200, 96, 32, 2, 4), (48, 512, 64, 5, 9), (17, 32, 32, 8, 130), (97, 64, 16, 6, 1),
    (60, 96, 16, 6, 2), (48, 160, 32, 5, 3), (96, 64, 32, 5, 1), (50, 128, 32, 5, 40),
    (64, 128, 32, 4, 20), (60, 64, 32, 6, 9)]


@pytest.mark.parametrize("rows, cols, group, bits, m", CASES)
def test_the_plain_gemm_is_its_twin(rows, cols, group, bits, m):
    w = int_weight(rows, cols, group, bits)
    packed = QuantPackedWeight(w)
    assert packed.bits == (4 if bits <= 4 else 5 if bits == 5 and group == 32 else
                           6 if bits <= 6 else 8)
    x = torch.randn(m, cols).bfloat16()
    bias = torch.randn(rows).bfloat16()
    exact = reference(x, w, bias)
    assert_bf16_of(packed.linear(x, bias), exact)
    assert torch.equal(packed.linear_float(x, bias), packed.linear(x, bias).float())
    assert_bf16_of(packed.linear(x.view(1, m, cols)).view(m, rows), reference(x, w))


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_a_gated_weight_gives_gate_up_and_silu_and_mul(bits):
    w = int_weight(2 * 70, 128, 32, bits, seed=1)  # d = 70: 3 half panels, the last partial
    packed = QuantPackedWeight(w, gated=True)
    x = torch.randn(6, 128).bfloat16()
    split = packed.linear(x)
    assert_bf16_of(split, reference(x, w))
    gate, up = split.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).bfloat16().float()
    got = packed.silu_and_mul(x).float()
    assert ((got - expected).abs() <= expected.abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("bits, zero, group", [(8, 128, 32), (4, 8, 32), (6, 32, 16),
                                               (5, 16, 32), (3, 4, 16)])
def test_a_symmetric_weight_keeps_its_scales_alone_and_is_its_twin(bits, zero, group):
    """Q8_0 / Q4_0 / Q6_K / Q5_0 / Q3_K's form (min = -zero * scale in every group): packed
    without mins (fewer bytes), its values moved up to the stored zero, the same results."""
    w = int_weight(96, 128, group, bits, seed=3)
    w = IntWeight(w.q, w.scale, -zero * w.scale, group, bits)
    packed = QuantPackedWeight(w)
    assert packed.symmetric and packed.quantization.endswith(" sym")
    full = QuantPackedWeight(IntWeight(w.q, w.scale, w.min * (1 + 1e-3), group, bits))
    assert not full.symmetric  # (a min that is not -zero * scale keeps its mins)
    assert packed.nbytes == full.nbytes - 96 * 128 // group * 2
    x = torch.randn(3, 128).bfloat16()
    assert_bf16_of(packed.linear(x), reference(x, w))
    rows = torch.tensor([0, 47, 95])
    torch.testing.assert_close(packed.rows(rows), fp16_rounded(w).dequantize()[rows])


def blocked_weight(rows: int, cols: int, group: int, bits: int, zero: int | None,
                   seed: int = 0) -> IntWeight:
    """A K-quant's form: an fp16 scale (and min) a block of 256 inputs times int8 sub-scales
    (6-bit sub-mins) a group; zero: symmetric (signed sub-scales, min = -zero * scale)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=g, dtype=torch.uint8)
    d = (torch.rand(rows, cols // 256, generator=g) * 1e-3 + 1e-4).half().float()
    low, high = (-128, 128) if zero else (0, 64)
    sub_scale = torch.randint(low, high, (rows, cols // group), generator=g, dtype=torch.int8)
    scale = d.repeat_interleave(256 // group, dim=1) * sub_scale.float()
    if zero:
        return IntWeight(q, scale, -zero * scale, group, bits,
                         blocks=SuperBlocks(sub_scale, None, d, None))
    dmin = -(torch.rand(rows, cols // 256, generator=g) * 1e-2).half().float()
    sub_min = torch.randint(0, 64, (rows, cols // group), generator=g, dtype=torch.int8)
    return IntWeight(q, scale, dmin.repeat_interleave(256 // group, dim=1) * sub_min.float(),
                     group, bits, blocks=SuperBlocks(sub_scale, sub_min, d, dmin))


@pytest.mark.parametrize("bits, group, zero", [(4, 32, None), (6, 16, 32), (5, 32, None),
                                               (2, 16, None), (3, 16, 4), (8, 32, None)])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_two_levels_keep_the_k_quants_own_scales_and_are_their_twin(bits, group, zero, m):
    """Q4_K / Q6_K / Q5_K / Q2_K / Q3_K's two levels packed as they are (int8 a group under an
    fp16 pair a block): fewer bytes than an fp16 pair a group, scales exact (no fp16
    rounding of their products), the twin's results across the tiles of 1-4 rows."""
    w = blocked_weight(100, 512, group, bits, zero)
    packed = QuantPackedWeight(w)
    assert packed.two_levels and packed.symmetric == (zero is not None)
    assert packed.quantization.startswith(f"int{packed.bits} g{group}/256")
    one = QuantPackedWeight(IntWeight(w.q, w.scale, w.min, group, bits))  # no blocks said
    assert not one.two_levels and one.symmetric == packed.symmetric
    tables, panels, values = 1 if zero else 2, 3, 48 * 512 * packed.bits // 8  # (a panel's)
    assert one.nbytes == panels * (values + 512 // group * 48 * 2 * tables)  # fp16 a group
    head = 48 * tables * (2 + 256 // group)  # fp16 a block, int8 a group, in whole lines
    assert packed.nbytes == panels * (values + 2 * (head + -head % 64)) < one.nbytes
    # the scales exact (no fp16 rounding of the products; float32's alone, where an fma fuses)
    torch.testing.assert_close(packed.rows(torch.arange(100)), w.dequantize())
    assert not torch.equal(one.rows(torch.arange(100)), w.dequantize())
    x = torch.randn(m, 512).bfloat16()
    bias = torch.randn(100).bfloat16()
    assert_bf16_of(packed.linear(x, bias), reference(x, w, bias, two_levels=True))
    assert_bf16_of(packed.linear_float(x), reference(x, w, two_levels=True))


@pytest.mark.parametrize("bits, zero", [(4, None), (6, 32)])
def test_two_levels_take_the_gated_epilogues_and_many_rows(bits, zero):
    w = blocked_weight(2 * 70, 768, 32 if zero is None else 16, bits, zero, seed=5)
    packed = QuantPackedWeight(w, gated=True)
    assert packed.two_levels
    x = torch.randn(70, 768).bfloat16()  # (past a 64-row block)
    split = packed.linear(x)
    assert_bf16_of(split, reference(x, w, two_levels=True))
    gate, up = split.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).bfloat16().float()
    got = packed.silu_and_mul(x).float()
    assert ((got - expected).abs() <= expected.abs() * 2 ** -7 + 1e-6).all()
    index = torch.tensor([0, 69, 70, 139])
    torch.testing.assert_close(packed.rows(index), w.dequantize()[index])


def test_blocks_the_layout_cannot_keep_fall_back_to_one_level():
    w = blocked_weight(48, 512, 32, 4, None)
    odd = SuperBlocks(w.blocks.sub_scale, w.blocks.sub_min, w.blocks.scale * (1 + 2 ** -20),
                      w.blocks.min)  # (a block scale fp16 does not hold)
    assert not QuantPackedWeight(IntWeight(w.q, w.scale, w.min, 32, 4, blocks=odd)).two_levels
    permuted = IntWeight(w.q, w.scale, w.min, 32, 4, perm=torch.randperm(512), blocks=w.blocks)
    assert not QuantPackedWeight(permuted).two_levels  # (act-order: not a K-quant's)
    narrow = blocked_weight(48, 512, 32, 4, None)
    cut = IntWeight(narrow.q[:, :480], narrow.scale[:, :15], narrow.min[:, :15], 32, 4,
                    blocks=narrow.blocks)  # (inputs not whole blocks)
    assert not QuantPackedWeight(cut).two_levels


@pytest.mark.parametrize("rows, cols, group, bits, m", CASES[:4])
def test_the_packed_rows_read_back_as_the_weight(rows, cols, group, bits, m):
    w = int_weight(rows, cols, group, bits)
    for gated in (False, True) if rows % 2 == 0 else (False,):
        packed = QuantPackedWeight(w, gated=gated)
        index = torch.randperm(rows)[:7]
        assert torch.equal(packed.rows(index), fp16_rounded(w).dequantize()[index])


def test_the_twin_is_the_float_product_up_to_int8_activations():
    w = int_weight(64, 256, 32, 4)
    x = torch.randn(5, 256)
    exact = x @ fp16_rounded(w).dequantize().T
    twin = reference(x.bfloat16(), w)
    error = (twin - x.bfloat16().float() @ fp16_rounded(w).dequantize().T).abs().max()
    assert error < 0.02 * exact.abs().max()
    assert error > 0  # the activations are quantized, not used as they are


def test_activations_are_quantized_per_row_and_group():
    x = torch.tensor([[1.0, -2.0] + [0.5] * 14 + [0.0] * 16, [254.0] + [1.0] * 31])
    xq, xs, xsum = quantize_activations(x, 16)
    assert xq[0, :3].tolist() == [64, -127, 32]  # 1 * 127/2 = 63.5 rounds to even
    assert xq[0, 16:].abs().sum() == 0 and xs[0, 1] == 0  # a zero group
    assert xq[1, :2].tolist() == [127, 0] and xq[1, 16:].tolist() == [127] * 16
    assert torch.allclose(xsum, xs * xq.float().view(2, 2, 16).sum(-1))


def test_what_the_kernel_cannot_take_is_refused():
    w = int_weight(16, 96, 32, 4)
    assert QuantPackedWeight.supports(w)
    assert not QuantPackedWeight.supports(IntWeight(w.q, w.scale.repeat_interleave(4, 1),
                                                    w.min.repeat_interleave(4, 1), 8, 4))
    huge = IntWeight(w.q, w.scale * 1e8, w.min, 32, 4)  # past fp16
    assert not QuantPackedWeight.supports(huge)
    with pytest.raises(RuntimeError, match="does not fit 4 bits"):
        QuantPackedWeight(IntWeight(w.q + 16, w.scale, w.min, 32, 4))
    packed = QuantPackedWeight(w)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        packed.linear(torch.randn(2, 96))


def test_a_quantized_weight_the_kernel_cannot_take_runs_in_bf16_and_says_so(caplog):
    import logging

    from aserve.backends.cpu_ops import _pack_linears
    from aserve.backends.ops import LinearToPack
    from aserve.kernels.cpu_gemm import PackedWeight

    w = int_weight(48, 96, 32, 4)
    odd = IntWeight(w.q, w.scale.repeat_interleave(4, 1), w.min.repeat_interleave(4, 1), 8, 4)
    dense = w.dequantize().bfloat16()
    logger = logging.getLogger("aserve.backends.cpu_ops")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="aserve.backends.cpu_ops"):
            packed = _pack_linears([LinearToPack(dense, False, lambda: w),
                                    LinearToPack(dense, False, lambda: odd),
                                    LinearToPack(dense, False, lambda: None)])
    finally:
        logger.removeHandler(caplog.handler)
    assert isinstance(packed[0], QuantPackedWeight)
    assert all(isinstance(p, PackedWeight) for p in packed[1:])
    assert "1 of 3 linear weights kept as integers" in caplog.text
    assert "1 (groups of 8 over 96 inputs" in caplog.text
    assert "1 (a part stored as floats" in caplog.text


def test_a_long_prompt_after_a_decode_gives_the_same_rows():
    """A prompt big enough that its activations' scratch is given back (> 32 MB), between two
    small calls on the same thread: each call's rows are its own."""
    w = int_weight(48, 8192, 32, 4)
    packed = QuantPackedWeight(w)
    small = torch.randn(2, 8192).bfloat16()
    before = packed.linear(small)
    big = torch.randn(4104, 8192).bfloat16()
    rows = packed.linear(big)
    assert_bf16_of(rows[-3:], reference(big[-3:], w))
    assert torch.equal(packed.linear(small), before)


def test_an_embedding_looks_rows_up_in_the_packed_integers():
    from aserve.layers.embedding import VocabEmbedding

    w = int_weight(100, 64, 32, 8)
    embedding = VocabEmbedding(100, 64).to(torch.bfloat16)
    embedding.use_packed_rows(QuantPackedWeight(w))
    assert embedding.weight.numel() == 0  # no float copy kept
    ids = torch.tensor([[3, 99], [0, 3]])
    expected = fp16_rounded(w).dequantize().bfloat16()
    assert torch.equal(embedding(ids), expected[ids])
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, 64)


def test_act_order_columns_are_gathered_before_the_gemm():
    """GPTQ's act-order: the packed columns are the inputs `perm` names; linear gathers x's
    columns first, `rows` puts them back in input order."""
    w = int_weight(40, 128, 32, 4)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    permuted = IntWeight(w.q, w.scale, w.min, 32, 4, perm)
    packed = QuantPackedWeight(permuted)
    x = torch.randn(3, 128).bfloat16()
    assert_bf16_of(packed.linear(x), reference(x, permuted))
    assert_bf16_of(packed.linear(x), reference(x[:, perm], w))  # the same as gathering first
    index = torch.tensor([5, 0])
    expected = IntWeight(w.q, w.scale.half().float(), w.min.half().float(), 32, 4,
                         perm).dequantize()
    assert torch.equal(packed.rows(index), expected[index])
    assert not torch.equal(expected, fp16_rounded(w).dequantize())  # the order matters
