"""The CPU bf16 fused MoE (`cpu_moe.CpuFusedMoE`) against its oracle `fused_moe_ref` in bf16, and
bit for bit against the dense loop it replaces: a `PackedWeight` per expert, the C++ element-wise
activation and torch's gather / index_add_, over a grid of shapes (hidden and intermediate sizes
that leave panels part-filled), activations, biases and expert maps."""

from __future__ import annotations

import itertools

import pytest
import torch

from aserve.kernels import cpu_elementwise
from aserve.kernels.cpu_gemm import PackedWeight
from aserve.kernels.cpu_moe import CpuFusedMoE
from aserve.kernels.moe import fused_moe_ref, local_slots, select_experts

pytestmark = pytest.mark.usefixtures("cpu_gemm_kernel")  # skips without AVX512-BF16

# (experts, top_k) with k <= E
ROUTINGS = [(e, k) for e, k in itertools.product([1, 4, 8], [1, 2, 4]) if k <= e]
HIDDEN = [32, 96, 128]  # the down GEMM's panels of 48: 32 and 128 part-fill one
INTERMEDIATE = [40, 48, 96]  # the gated panels of 24 outputs: 40 part-fills one
TOKENS = [0, 1, 5, 33]
ACTIVATIONS = [("silu", None), ("gelu_tanh", None), ("swiglu_oai", None), ("swiglu_oai", 1.5)]


def make_case(num_experts: int, top_k: int, hidden: int, inter: int, tokens: int, *,
              activation: str = "silu", limit: float | None = None, bias: bool = False,
              remote: bool = False, seed: int = 0) -> dict:
    """Random bf16 experts and a softmax top-k routing. `remote`: as many experts again are
    another rank's, the local ones at shuffled global ids (expert_map -1 elsewhere)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    num_global = 2 * num_experts if remote else num_experts
    expert_map = None
    if remote:
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(num_global, generator=gen)[:num_experts]] = torch.arange(
            num_experts, dtype=torch.int32)
    weights, ids = select_experts(torch.randn(tokens, num_global, generator=gen), top_k,
                                  renormalize=True)
    return {"x": randn(tokens, hidden), "topk_weights": weights, "topk_ids": ids,
            "w13": randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
            "w2": randn(num_experts, hidden, inter, scale=inter**-0.5),
            "w13_bias": randn(num_experts, 2 * inter) if bias else None,
            "w2_bias": randn(num_experts, hidden) if bias else None,
            "expert_map": expert_map, "activation": activation, "limit": limit}


OPTIONS = ("w13_bias", "w2_bias", "expert_map", "activation", "limit")


def fused(case: dict) -> torch.Tensor:
    op = CpuFusedMoE(case["w13"], case["w2"], **{k: case[k] for k in OPTIONS})
    return op(case["x"], case["topk_weights"], case["topk_ids"])


def reference(case: dict) -> torch.Tensor:
    return fused_moe_ref(case["x"], case["w13"], case["w2"], case["topk_weights"],
                         case["topk_ids"], **{k: case[k] for k in OPTIONS})


def dense_loop(case: dict) -> torch.Tensor:
    """Experts one by one through the dense path: PackedWeight linears (plain, with the bias),
    the C++ element-wise activation, index_add_ of the weighted rows (fused_moe_ref's order)."""
    x, w13, w2, b13, b2 = (case[k] for k in ("x", "w13", "w2", "w13_bias", "w2_bias"))
    act = {"silu": cpu_elementwise.silu_and_mul,
           "gelu_tanh": cpu_elementwise.gelu_tanh_and_mul,
           "swiglu_oai": lambda h: cpu_elementwise.swiglu_oai_and_mul(h, limit=case["limit"])}
    local = local_slots(case["topk_ids"], case["expert_map"])  # [T, k]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(local[local >= 0]).tolist():
        slot, token = torch.where(local.T == e)
        h = PackedWeight(w13[e]).linear(x[token], None if b13 is None else b13[e])
        h = act[case["activation"]](h)
        y = PackedWeight(w2[e]).linear(h, None if b2 is None else b2[e])
        out.index_add_(0, token, y.float() * case["topk_weights"][token, slot, None])
    return out.bfloat16()


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two bf16 GEMMs summing in other orders: a bf16 step in some intermediate values."""
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", INTERMEDIATE)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_experts,top_k", ROUTINGS)
def test_fused_moe_is_bit_equal_to_the_dense_loop_and_close_to_the_reference(
        num_experts, top_k, hidden, inter, tokens):
    case = make_case(num_experts, top_k, hidden, inter, tokens, seed=tokens + hidden + inter)
    got = fused(case)
    assert torch.equal(got, dense_loop(case))
    assert_close_to_reference(got, reference(case))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation,limit", ACTIVATIONS)
@pytest.mark.parametrize("num_experts,top_k,hidden,inter", [(4, 2, 96, 40), (8, 4, 128, 96)])
def test_every_activation_bias_and_expert_map_matches(num_experts, top_k, hidden, inter,
                                                      activation, limit, bias, remote, tokens):
    case = make_case(num_experts, top_k, hidden, inter, tokens, activation=activation,
                     limit=limit, bias=bias, remote=remote, seed=tokens)
    got = fused(case)
    assert torch.equal(got, dense_loop(case))
    assert_close_to_reference(got, reference(case))


def test_experts_with_zero_one_and_many_tokens_and_a_repeated_expert():
    case = make_case(4, 2, 96, 48, 4, bias=True)
    # expert 0: three rows, 1: two, 2: one, 3: none; token 3 routes to expert 1 twice
    case["topk_ids"] = torch.tensor([[0, 1], [2, 0], [0, 1], [1, 1]])
    got = fused(case)
    assert torch.equal(got, dense_loop(case))
    assert_close_to_reference(got, reference(case))


def test_tokens_routed_only_to_other_ranks_get_zeros():
    case = make_case(4, 2, 96, 48, 5, remote=True, bias=True)
    remote_ids = torch.nonzero(case["expert_map"] < 0).flatten()
    case["topk_ids"][:2] = remote_ids[:2]  # tokens 0 and 1: no local slot
    got = fused(case)
    assert torch.equal(got[:2], torch.zeros(2, 96, dtype=torch.bfloat16))
    assert torch.equal(got, dense_loop(case))


def test_takes_strided_rows_int32_ids_and_keeps_no_raw_weight():
    case = make_case(8, 2, 128, 96, 9, bias=True, activation="gelu_tanh")
    want = fused(case)
    op = CpuFusedMoE(case["w13"], case["w2"], **{k: case[k] for k in OPTIONS})
    case["w13"].zero_()  # the op packed its own copy: the raw weights may go
    case["w2"].zero_()
    wide = torch.cat([case["x"], case["x"]], dim=1)[:, :128]  # strided rows
    got = op(wide, case["topk_weights"], case["topk_ids"].int())
    assert not wide.is_contiguous() and torch.equal(got, want)


def test_fused_moe_refuses_an_expert_id_outside_the_map():
    case = make_case(4, 2, 96, 48, 3)
    op = CpuFusedMoE(case["w13"], case["w2"])
    with pytest.raises(RuntimeError, match="expert id"):
        op(case["x"], case["topk_weights"], torch.tensor([[0, 1], [4, 0], [1, 2]]))


@pytest.mark.parametrize("shape", [(4, 90, 96), (4, 96, 33)])  # I odd; H odd
def test_supports_only_even_hidden_and_intermediate_sizes(shape):
    e, two_i, h = shape
    w13 = torch.zeros(e, two_i, h, dtype=torch.bfloat16)
    w2 = torch.zeros(e, h, two_i // 2, dtype=torch.bfloat16)
    assert not CpuFusedMoE.supports(w13, w2)
    assert CpuFusedMoE.supports(torch.zeros(4, 96, 64, dtype=torch.bfloat16),
                                torch.zeros(4, 64, 48, dtype=torch.bfloat16))
    assert not CpuFusedMoE.supports(torch.zeros(4, 96, 64), torch.zeros(4, 64, 48))
