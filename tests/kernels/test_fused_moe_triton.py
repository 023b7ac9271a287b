"""`fused_moe_triton` against its oracle `fused_moe_ref` over a grid of experts, top-k, hidden
and intermediate sizes and token counts; every activation, biases, expert parallelism
(`expert_map` with -1 entries), float32 / bfloat16 / float16; the expert alignment on its own;
and, on a GPU, a CUDA-graph capture (the launcher reads nothing back from the device).

Routing is built so that, where E leaves room, one expert gets no token and one exactly one.
On a CUDA/ROCm machine the kernels run on the GPU; elsewhere under the Triton interpreter
(`TRITON_INTERPRET=1`, set by conftest.py), which rounds float32 -> bfloat16 by truncation.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from aserve.kernels.fused_moe_triton import (  # noqa: E402
    _block_sizes,
    _gate_up_kernel,
    align_by_expert,
    fused_moe_ref,
    fused_moe_triton,
)
from aserve.kernels.triton_utils import is_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not is_interpreted(_gate_up_kernel):
    pytest.skip("no GPU, and the kernels were decorated before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

EXPERTS_TOPK = [(1, 1), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
ACTIVATIONS = [("silu", None), ("gelu_tanh", None), ("swiglu_oai", None), ("swiglu_oai", 1.0)]
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
       torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
       torch.float16: {"atol": 5e-3, "rtol": 5e-3}}


def make_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64), k distinct experts per token. With
    E >= k + 2 the last expert gets no token and the one before it only token 0."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)  # [T, E]
    if num_experts >= top_k + 2:
        scores[:, -1] = -1.0
        scores[:, -2] = -1.0
        scores[:1, -2] = 2.0
    ids = scores.topk(top_k, dim=-1).indices  # [T, k]
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    return weights, ids


def make_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 gen: torch.Generator, bias: bool = False) -> dict[str, torch.Tensor | None]:
    """w13 [E, 2I, H], w2 [E, H, I] scaled for O(1) outputs, optional biases."""
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return {"w13": randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
            "w2": randn(num_experts, hidden, inter, scale=inter**-0.5),
            "w13_bias": randn(num_experts, 2 * inter, scale=0.5) if bias else None,
            "w2_bias": randn(num_experts, hidden, scale=0.5) if bias else None}


def run_both(x: torch.Tensor, experts: dict, weights: torch.Tensor, ids: torch.Tensor,
             expert_map: torch.Tensor | None = None, **options
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused_moe_triton on DEVICE, back on the CPU; fused_moe_ref on the CPU)."""
    def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DEVICE)

    got = fused_moe_triton(*map(on_device, (x, experts["w13"], experts["w2"], weights, ids)),
                           w13_bias=on_device(experts["w13_bias"]),
                           w2_bias=on_device(experts["w2_bias"]),
                           expert_map=on_device(expert_map), **options)
    want = fused_moe_ref(x, experts["w13"], experts["w2"], weights, ids,
                         w13_bias=experts["w13_bias"], w2_bias=experts["w2_bias"],
                         expert_map=expert_map, **options)
    return got.cpu(), want


def test_routing_gives_an_expert_no_token_and_one_exactly_one():
    weights, ids = make_routing(17, 8, 4, torch.Generator().manual_seed(0))
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert counts[-1] == 0 and counts[-2] == 1 and counts.sum() == 17 * 4
    assert all(len(set(row)) == 4 for row in ids.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.ones(17))


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("hidden,inter", [(16, 16), (32, 24), (48, 16), (48, 24)])
@pytest.mark.parametrize("num_experts,top_k", EXPERTS_TOPK)
def test_matches_the_reference_in_float32_over_shapes(num_experts, top_k, hidden, inter,
                                                      num_tokens):
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k * 10 + num_tokens)
    experts = make_experts(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = make_routing(num_tokens, num_experts, top_k, gen)
    got, want = run_both(x, experts, weights, ids)
    assert got.shape == (num_tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation,limit", ACTIVATIONS)
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (4, 4)])
def test_every_activation_with_and_without_biases_in_float32(num_experts, top_k, activation,
                                                              limit, bias):
    gen = torch.Generator().manual_seed(7)
    experts = make_experts(num_experts, 48, 24, torch.float32, gen, bias=bias)
    x = torch.randn(17, 48, generator=gen) * 2  # |gate| past the limit of 1.0 often
    weights, ids = make_routing(17, num_experts, top_k, gen)
    got, want = run_both(x, experts, weights, ids, activation=activation, limit=limit,
                         alpha=1.5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("activation,limit", ACTIVATIONS)
@pytest.mark.parametrize("num_experts,top_k,num_tokens,hidden,inter",
                         [(8, 2, 17, 48, 24), (4, 1, 3, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_as_close_to_float32_as_the_reference(dtype, num_experts, top_k,
                                                                  num_tokens, hidden, inter,
                                                                  activation, limit):
    gen = torch.Generator().manual_seed(11)
    experts = make_experts(num_experts, hidden, inter, dtype, gen, bias=True)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = make_routing(num_tokens, num_experts, top_k, gen)
    got, want = run_both(x, experts, weights, ids, activation=activation, limit=limit)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    exact = fused_moe_ref(x.float(), *(experts[n].float() for n in ("w13", "w2")), weights, ids,
                          activation=activation, limit=limit,
                          w13_bias=experts["w13_bias"].float(), w2_bias=experts["w2_bias"].float())
    kernel_err = (got.float() - exact).abs().max().item()
    ref_err = (want.float() - exact).abs().max().item()
    step = torch.finfo(dtype).eps * exact.abs().max().item()  # one rounding at the output's scale
    assert kernel_err <= 2 * ref_err + step, (kernel_err, ref_err, step)


# rank 0 holds global experts 1, 3, 4, 6 (local 0-3); rank 1 the others
EXPERT_MAPS = [torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32),
               torch.tensor([0, -1, 1, -1, -1, 2, -1, 3], dtype=torch.int32)]
RANK_EXPERTS = [[1, 3, 4, 6], [0, 2, 5, 7]]


@pytest.mark.parametrize("activation,limit", [("silu", None), ("swiglu_oai", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_ranks_add_only_their_experts_and_sum_to_the_whole(dtype, activation,
                                                                           limit):
    gen = torch.Generator().manual_seed(3)
    full = make_experts(8, 32, 24, dtype, gen, bias=True)
    x = torch.randn(17, 32, generator=gen).to(dtype)
    weights, ids = make_routing(17, 8, 2, gen)
    ids[5] = torch.tensor([0, 2])  # every slot of token 5 on rank 1: zero on rank 0
    shares = []
    for expert_map, held in zip(EXPERT_MAPS, RANK_EXPERTS):
        local = {name: t[held] for name, t in full.items()}
        got, want = run_both(x, local, weights, ids, activation=activation, limit=limit,
                             expert_map=expert_map)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        shares.append(got.float())
    assert torch.all(shares[0][5] == 0)
    whole = fused_moe_ref(x, full["w13"], full["w2"], weights, ids, activation=activation,
                          limit=limit, w13_bias=full["w13_bias"], w2_bias=full["w2_bias"])
    torch.testing.assert_close(shares[0] + shares[1], whole.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 2)])
def test_many_tiles_k_steps_and_blocks_per_expert_on_strided_rows(num_experts, top_k, dtype):
    """H = 160, I = 80: several column tiles and K steps, with tails; with 4 experts every
    token's first slot goes to expert 0: 40 rows, two blocks of 32."""
    gen = torch.Generator().manual_seed(5)
    experts = make_experts(num_experts, 160, 80, dtype, gen, bias=True)
    x = torch.randn(40, 200, generator=gen).to(dtype)[:, 20:180]  # row stride 200
    weights, ids = make_routing(40, num_experts, top_k, gen)
    if num_experts > 1:
        ids = torch.stack([torch.zeros(40, dtype=torch.int64),
                           torch.randint(1, num_experts, (40,), generator=gen)], dim=1)
        block_m = _block_sizes(40 * top_k, num_experts, dtype == torch.float32)[0]
        assert block_m < 40
    got, want = run_both(x, experts, weights, ids.int(), activation="gelu_tanh")
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("num_experts,block_m", [(1, 16), (4, 16), (8, 32), (5, 64)])
def test_alignment_sorts_pairs_by_expert_in_padded_blocks(num_experts, block_m):
    gen = torch.Generator().manual_seed(num_experts)
    local = torch.randint(-1, num_experts, (53,), generator=gen)
    local[:3] = num_experts - 1  # some expert gets a run
    pair_ids, block_experts = align_by_expert(local, num_experts, block_m)
    num_blocks = -(-(53 + num_experts * (block_m - 1)) // block_m)
    assert pair_ids.shape == (num_blocks * block_m,) and block_experts.shape == (num_blocks,)
    blocks = pair_ids.view(num_blocks, block_m).tolist()
    seen = []
    for expert in range(num_experts):
        rows = [p for b, e in zip(blocks, block_experts.tolist()) if e == expert for p in b]
        want = torch.where(local == expert)[0].tolist()  # by pair
        assert rows == want + [53] * (len(rows) - len(want)), expert
        assert len(rows) == -(-len(want) // block_m) * block_m  # padded to whole blocks
        seen += want
    unused = [b for b, e in zip(blocks, block_experts.tolist()) if e < 0]
    assert all(p == 53 for b in unused for p in b)
    assert sorted(seen) == torch.where(local >= 0)[0].tolist()  # remote pairs dropped
    assert block_experts.tolist() == sorted(block_experts.tolist(), key=lambda e: e < 0)


def test_no_tokens_gives_an_empty_result_in_x_dtype():
    experts = make_experts(4, 32, 16, torch.bfloat16, torch.Generator().manual_seed(0))
    got = fused_moe_triton(torch.zeros(0, 32, dtype=torch.bfloat16, device=DEVICE),
                           experts["w13"].to(DEVICE), experts["w2"].to(DEVICE),
                           torch.zeros(0, 2, device=DEVICE),
                           torch.zeros(0, 2, dtype=torch.int64, device=DEVICE))
    assert got.shape == (0, 32) and got.dtype == torch.bfloat16


def test_rejects_bad_shapes_dtypes_and_activations():
    experts = make_experts(4, 32, 16, torch.float32, torch.Generator().manual_seed(0))
    w13, w2 = experts["w13"].to(DEVICE), experts["w2"].to(DEVICE)
    x = torch.randn(3, 32, device=DEVICE)
    weights = torch.full((3, 2), 0.5, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_triton(x, w13, w2[:, :16], weights, ids)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe_triton(x.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="unknown expert activation"):
        fused_moe_triton(x, w13, w2, weights, ids, activation="relu")
    with pytest.raises(ValueError, match="w2_bias"):
        fused_moe_triton(x, w13, w2, weights, ids, w2_bias=torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="int32/int64"):
        fused_moe_triton(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match=r"\[T=3, k\]"):
        fused_moe_triton(x, w13, w2, weights[:2], ids[:2])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        fused_moe_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_a_cuda_graph_replays_the_layer_for_new_routing():
    gen = torch.Generator().manual_seed(9)
    experts = {k: v.cuda() for k, v in make_experts(8, 64, 96, torch.bfloat16, gen).items()
               if v is not None}
    x = torch.randn(24, 64, generator=gen).bfloat16().cuda()
    weights, ids = (t.cuda() for t in make_routing(24, 8, 2, gen))
    fused_moe_triton(x, experts["w13"], experts["w2"], weights, ids)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, experts["w13"], experts["w2"], weights, ids)
    new_weights, new_ids = make_routing(24, 8, 2, torch.Generator().manual_seed(10))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = fused_moe_triton(x, experts["w13"], experts["w2"], weights, ids)
    assert torch.equal(out, want)
