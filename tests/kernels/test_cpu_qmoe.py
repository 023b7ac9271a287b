"""A quantized MoE layer's experts in one C++ call (`csrc/qmoe.h`, `QuantFusedMoE`) against
the same experts one GEMM call each in Python (`QuantFusedMoE.loop`): bit-equal across bits,
GGUF's and GPTQ's groups, token counts that cross the 4-row tile and the 64-row block, widths
that leave a panel partly empty, top-k up to 4 and experts of another rank; experts the call
does not take (biases, another activation, act-order) keep the loop; and the loop itself is
the float experts up to the activations' int8 error."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import cpu_qgemm
from aserve.kernels.cpu_qgemm import QuantFusedMoE
from aserve.kernels.moe import fused_moe_ref
from aserve.quantization.int_weights import IntWeight

pytestmark = pytest.mark.skipif(not cpu_qgemm.available(),
                                reason="the CPU or build lacks AVX512-VNNI and AVX2")


def int_weight(rows: int, cols: int, group: int, bits: int, g: torch.Generator) -> IntWeight:
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // group, generator=g) * 0.02 + 0.001
    low = -scale * (2 ** (bits - 1)) * (1 + 0.1 * torch.rand(rows, cols // group, generator=g))
    return IntWeight(q, scale, low, group, bits)


def experts(num: int, hidden: int, inter: int, group: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return ([int_weight(2 * inter, hidden, group, bits, g) for _ in range(num)],
            [int_weight(hidden, inter, group, bits, g) for _ in range(num)])


def routing(tokens: int, num_global: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_global, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    return weights, ids


CASES = [  # experts, hidden, intermediate, group, bits, tokens, k
    (4, 96, 48, 32, 4, 1, 2), (8, 128, 64, 32, 8, 5, 2), (3, 64, 32, 16, 4, 70, 3),
    (6, 256, 128, 128, 4, 9, 4), (5, 112, 64, 16, 8, 130, 1)]


@pytest.mark.skipif(not cpu_qgemm.vnni(), reason="the one call is AVX512-VNNI's")
@pytest.mark.parametrize("num, hidden, inter, group, bits, tokens, k", CASES)
def test_one_call_is_the_loop(num, hidden, inter, group, bits, tokens, k):
    w13, w2 = experts(num, hidden, inter, group, bits)
    moe = QuantFusedMoE(w13, w2)
    assert moe.stacked is not None
    x = torch.randn(tokens, hidden).bfloat16()
    weights, ids = routing(tokens, num, k)
    got = moe(x, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
    assert torch.equal(got, moe.loop(x, weights, ids))


def test_experts_of_another_rank_are_skipped():
    """Global ids 0..7, this rank holds 2..5 (expert_map): other experts' slots add nothing;
    a token routed to none of them gets zeros."""
    w13, w2 = experts(4, 96, 48, 32, 4, seed=3)
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[2:6] = torch.arange(4, dtype=torch.int32)
    moe = QuantFusedMoE(w13, w2, expert_map=expert_map)
    x = torch.randn(12, 96).bfloat16()
    weights, ids = routing(12, 8, 2, seed=4)
    ids[0] = torch.tensor([0, 7])  # nobody's here
    got = moe(x, weights, ids)
    assert torch.equal(got, moe.loop(x, weights, ids))
    assert torch.equal(got[0], torch.zeros(96, dtype=torch.bfloat16))
    assert got[1:].abs().sum() > 0


def test_the_loop_serves_what_the_call_does_not_take():
    w13, w2 = experts(3, 64, 32, 32, 4, seed=5)
    bias = torch.randn(3, 64).bfloat16()
    assert QuantFusedMoE(w13, w2, w2_bias=bias).stacked is None
    assert QuantFusedMoE(w13, w2, activation="gelu_tanh").stacked is None
    perm = torch.randperm(64)
    ordered = [IntWeight(w.q, w.scale, w.min, w.group, w.bits, perm) for w in w13]
    assert QuantFusedMoE(ordered, w2).stacked is None
    mixed = [*w2[:2], IntWeight(w2[2].q, w2[2].scale.repeat_interleave(2, 1)[:, :2],
                                 w2[2].min.repeat_interleave(2, 1)[:, :2], 16, 4)]
    assert QuantFusedMoE(w13, mixed).stacked is None  # (one expert in other groups)


def test_the_loop_is_the_float_experts():
    """Against `fused_moe_ref` over the dequantized experts: the int8 activations' error only."""
    w13, w2 = experts(4, 128, 64, 32, 8, seed=6)
    moe = QuantFusedMoE(w13, w2)
    x = torch.randn(6, 128).bfloat16()
    weights, ids = routing(6, 4, 2, seed=7)
    got = moe(x, weights, ids).float()
    dense13 = torch.stack([w.dequantize() for w in w13]).bfloat16()
    dense2 = torch.stack([w.dequantize() for w in w2]).bfloat16()
    want = fused_moe_ref(x, dense13, dense2, weights, ids).float()
    assert ((got - want).abs() <= 0.03 * want.abs().max()).all()
