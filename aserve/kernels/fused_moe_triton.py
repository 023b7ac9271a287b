"""The experts of a MoE layer in Triton (CUDA and ROCm): `fused_moe_triton`, with the contract
of its oracle `fused_moe_ref` (`moe.py`, which draws the weight layout).

The T * k (token, slot) pairs are numbered `pair = t * k + j`. `align_by_expert` sorts them by
local expert (stable: by pair within an expert) and pads each expert's segment to a multiple of
BLOCK_M; pairs routed to another rank are dropped. Each block of BLOCK_M rows has one expert
(-1: a block past the last segment, which exits at once):

```
local ids (T=3, k=2):  pair 0:e1  1:e0  2:e1  3:e3  4:-1  5:e1             BLOCK_M = 4, E = 4
pair_ids:     | 1  P  P  P | 0  2  5  P | 3  P  P  P | P  P  P  P | ...     P = T * k: padding
block_experts:   0           1           3           -1           ...      (e2 has no block)
```

Buffers are sized by the bound `T * k + E * (BLOCK_M - 1)` rows and the grids by it, so nothing
is read back from the device (the layer can be captured in a CUDA graph). Then two grouped
GEMMs, each program one (block, column tile), float32 accumulation:

    _gate_up_kernel  rows of x gathered by token, the gate and up tiles of the same
                     intermediate columns, + bias, the activation  -> h [rows, I] in x's dtype
    _down_kernel     h W2[e]^T + bias, times the slot's routing weight
                                                         -> y [T * k, H] float32 at the pair's row

and `y.view(T, k, H).sum(1)` in float32, cast to x's dtype (slots routed elsewhere stay zero).

Not here: quantised weights, chunking of very large batches, autotuned tile sizes.
"""

from __future__ import annotations

import torch

from aserve.kernels.moe import ACTIVATIONS, fused_moe_ref, local_slots
from aserve.kernels.triton_utils import check_float, is_interpreted, next_pow2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the launcher says what is missing
    triton = None

__all__ = ["align_by_expert", "fused_moe_ref", "fused_moe_triton"]

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                  torch.bfloat16: tl.bfloat16}

    @triton.jit
    def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr):
        """`apply_activation` on float32 tiles of [gate | up]."""
        if ACTIVATION == "silu":
            return gate * tl.sigmoid(gate) * up
        elif ACTIVATION == "gelu_tanh":
            # 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            return gate * tl.sigmoid(2.0 * u) * up
        else:  # swiglu_oai
            if HAS_LIMIT:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))

    @triton.jit
    def _block_rows(pair_ptr, num_pairs, BLOCK_M: tl.constexpr):
        """This program's block: rows [BLOCK_M] int64, their pair ids, and which of them hold a
        pair (not padding)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows)
        return rows, pair, pair < num_pairs

    # num_pairs varies with the batch: not specialised on, so every batch size runs one build
    @triton.jit(do_not_specialize=["num_pairs"])
    def _gate_up_kernel(x_ptr, w_ptr, b_ptr, h_ptr, pair_ptr, block_expert_ptr, num_pairs,
                        top_k, hidden, inter, alpha, limit, stride_xt, stride_we, stride_wn,
                        stride_be, stride_ht, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_LIMIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        PRECISION: tl.constexpr):
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        if expert < 0:
            return  # past the last expert's blocks
        rows, pair, row_ok = _block_rows(pair_ptr, num_pairs, BLOCK_M)
        token = (pair // top_k).to(tl.int64)  # [BLOCK_M]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + token[:, None] * stride_xt  # [BLOCK_M, 1]
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # [1, BN]
        w_up = w_gate + inter * stride_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + ks
            a_mask = row_ok[:, None] & (k[None, :] < hidden)  # [BLOCK_M, BLOCK_K]
            w_mask = (k[:, None] < hidden) & col_ok[None, :]  # [BLOCK_K, BLOCK_N]
            a = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0).to(DOT_DTYPE)
            g = tl.load(w_gate + k[:, None], mask=w_mask, other=0.0).to(DOT_DTYPE)
            u = tl.load(w_up + k[:, None], mask=w_mask, other=0.0).to(DOT_DTYPE)
            acc_gate = tl.dot(a, g, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
        if HAS_BIAS:
            bias = b_ptr + expert.to(tl.int64) * stride_be + cols
            acc_gate += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(bias + inter, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h = _activate(acc_gate, acc_up, alpha, limit, ACTIVATION, HAS_LIMIT)
        tl.store(h_ptr + rows[:, None] * stride_ht + cols[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _down_kernel(h_ptr, w_ptr, b_ptr, topk_w_ptr, y_ptr, pair_ptr, block_expert_ptr,
                     num_pairs, hidden, inter, stride_ht, stride_we, stride_wn, stride_be,
                     stride_yt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     PRECISION: tl.constexpr):
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        if expert < 0:
            return  # past the last expert's blocks
        rows, pair, row_ok = _block_rows(pair_ptr, num_pairs, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + rows[:, None] * stride_ht  # [BLOCK_M, 1]
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # [1, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + ks
            a = tl.load(h_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < inter),
                        other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_cols + k[:, None], mask=(k[:, None] < inter) & col_ok[None, :],
                        other=0.0).to(DOT_DTYPE)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            bias = b_ptr + expert.to(tl.int64) * stride_be + cols
            acc += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc *= tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_yt + cols[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :])
else:  # no triton: the launcher raises require_triton's RuntimeError
    _gate_up_kernel = _down_kernel = None


def align_by_expert(local_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """local_ids [P] (-1: another rank's) -> (pair_ids [num_blocks * block_m] int32, P where
    padding; block_experts [num_blocks] int32, -1 past the last segment), the layout drawn in
    the module docstring, with num_blocks = ceil((P + E * (block_m - 1)) / block_m).

    Torch ops only, none of which reads a value back to the host.
    """
    num_pairs, device = local_ids.numel(), local_ids.device
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    num_rows = num_blocks * block_m
    key = torch.where(local_ids >= 0, local_ids, num_experts)  # [P]: remote pairs sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E + 1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(key, stable=True)  # [P]: sorted position -> pair
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_key]
    row_of_expert = torch.cat([padded_end - padded, padded.new_full((1,), num_rows)])  # [E + 1]
    dest = torch.where(sorted_key < num_experts, row_of_expert[sorted_key] + rank, num_rows)
    pair_ids = torch.full((num_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, dest, order.to(torch.int32))  # remote pairs land in the spare last row
    starts = torch.arange(num_blocks, device=device) * block_m  # [num_blocks]
    block_experts = torch.searchsorted(padded_end, starts, right=True)  # first end > start
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return pair_ids[:num_rows], block_experts.to(torch.int32)


def _block_sizes(num_pairs: int, num_experts: int, is_fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): BLOCK_M about the mean rows per expert (16 to 64: padding
    wastes less of a small block); float32 (exact dots on FMA units) a shorter K step."""
    block_m = min(64, max(16, next_pow2(-(-num_pairs // num_experts))))
    return block_m, 64, 32 if is_fp32 else 64


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                  w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                  expert_map: torch.Tensor | None) -> None:
    name = "fused_moe_triton"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: unknown expert activation {activation!r}; known: "
                         f"{', '.join(ACTIVATIONS)}.")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{name}: x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I], got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}.")
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if (two_inter % 2 or hidden != x.shape[1]
            or tuple(w2.shape) != (num_experts, hidden, inter)):
        raise ValueError(f"{name}: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"[E, 2I, H={x.shape[1]}] and [E, H, I].")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"{name}: x, w13 and w2 must share a dtype, got {x.dtype}, "
                         f"{w13.dtype}, {w2.dtype}.")
    biases = {"w13_bias": (w13_bias, (num_experts, two_inter)),
              "w2_bias": (w2_bias, (num_experts, hidden))}
    for arg, (bias, shape) in biases.items():
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name}: {arg} must be {list(shape)}, got {tuple(bias.shape)}.")
    check_float(name, x=x, w13=w13, w2=w2,
                **{arg: b for arg, (b, _) in biases.items() if b is not None})
    if not topk_weights.is_floating_point():
        raise ValueError(f"{name}: topk_weights must be float, got {topk_weights.dtype}.")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or (
            topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"{name}: topk_weights and topk_ids must both be [T={x.shape[0]}, k], "
                         f"got {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}.")
    ints = {"topk_ids": topk_ids} if expert_map is None else {"topk_ids": topk_ids,
                                                              "expert_map": expert_map}
    for arg, ids in ints.items():
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {arg} must be int32/int64, got {ids.dtype}.")
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError(f"{name}: expert_map must be [E_global], got {tuple(expert_map.shape)}.")


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                     activation: str = "silu", w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None,
                     expert_map: torch.Tensor | None = None, alpha: float = 1.702,
                     limit: float | None = None) -> torch.Tensor:
    """`fused_moe_ref` in Triton: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k]
    float32, topk_ids [T, k] global ids (`expert_map` [E_global] -> local index or -1)
    -> [T, H] in x's dtype.

    Every tensor must have a unit last stride. Ids are not read back to the host, so one out of
    range is not caught here (as on the device in general).
    """
    tensors = [t for t in (x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map)
               if t is not None]
    require_triton("fused_moe_triton", _gate_up_kernel, *tensors)
    _check_inputs(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter, num_pairs = two_inter // 2, num_tokens * top_k
    if num_pairs == 0 or num_experts == 0:  # no token, or a rank holding no expert
        return torch.zeros_like(x)
    block_m, block_n, block_k = _block_sizes(num_pairs, num_experts, x.dtype == torch.float32)
    pair_ids, block_experts = align_by_expert(local_slots(topk_ids, expert_map).reshape(-1),
                                              num_experts, block_m)
    h = torch.empty(pair_ids.shape[0], inter, dtype=x.dtype, device=x.device)  # [rows, I]
    y = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [T * k, H]
    # the interpreter's bfloat16 dot is wrong (see is_interpreted); float16 runs as on the GPU
    dot_fp32 = x.dtype == torch.float32 or (
        x.dtype == torch.bfloat16 and is_interpreted(_gate_up_kernel))
    dots = {"DOT_DTYPE": tl.float32 if dot_fp32 else _TL_DTYPES[x.dtype],
            "PRECISION": "ieee" if x.dtype == torch.float32 else None}
    num_blocks = block_experts.shape[0]
    b13 = w13 if w13_bias is None else w13_bias  # a stand-in pointer, never read without bias
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, b13, h, pair_ids, block_experts, num_pairs, top_k, hidden, inter,
        float(alpha), float(limit or 0.0), x.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0), h.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        ACTIVATION=activation, HAS_BIAS=w13_bias is not None, HAS_LIMIT=limit is not None,
        **dots)
    b2 = w2 if w2_bias is None else w2_bias
    weights = topk_weights.float().reshape(-1)  # [T * k] by pair
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, b2, weights, y, pair_ids, block_experts, num_pairs, hidden, inter, h.stride(0),
        w2.stride(0), w2.stride(1), b2.stride(0), y.stride(0), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w2_bias is not None, **dots)
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
