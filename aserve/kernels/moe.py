"""Mixture-of-experts references: routing (`select_experts`) and the experts (`fused_moe_ref`).

`fused_moe_ref` is the float32 oracle of every fused-MoE kernel (Triton in
`fused_moe_triton.py`, C++ in `cpu_moe.py`): tokens grouped per expert, one linear per expert
over its rows, the activation, the down projection, each token's weighted outputs summed in
float32 — transformers' eager experts loop, bit for bit in float32 (its default `grouped_mm`
runs torch's grouped GEMM, which rounds differently in the last bits).

Weights are in one layout whatever the checkpoint's (the loader converts):

```
w13 [E, 2I, H]   rows [gate (I) ; up (I)] of each expert      (gpt-oss' interleaved columns
w2  [E, H, I]                                                   are de-interleaved at load)
out[t] = sum_j  w[t, j] * (act(x[t] W13[e]^T + b13[e]) W2[e]^T + b2[e]),  e = ids[t, j]
```

Under expert parallelism a rank holds only some experts: `expert_map[e]` is the local index of
global expert e, or -1 where another rank holds it; a slot routed elsewhere adds nothing here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.kernels.activation import (
    gelu_tanh_and_mul_ref,
    silu_and_mul_ref,
    swiglu_oai_and_mul_ref,
)

# activations of the gated experts: act([gate | up]) -> [I]
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
SCORINGS = ("softmax", "topk_softmax")


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   renormalize: bool = False,
                   weights_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights: router_logits [T, E] ->
    (weights [T, k] float32, ids [T, k] int64), the highest weight first.

    scoring "softmax": a float32 softmax over all experts, then the top k (renormalised to sum
    to 1 with `renormalize`: Mixtral always, Qwen-MoE with `norm_topk_prob`); "topk_softmax":
    the top k logits, then a softmax over those k (gpt-oss; its router bias is in the logits),
    in the logits' dtype as HF computes it. `weights_dtype`: round the weights through it (HF's
    Qwen-MoE casts them to the model dtype); ties go the way torch.topk breaks them, as in HF.
    """
    if scoring == "softmax":
        probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif scoring == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)  # [T, k]
        weights = torch.softmax(values, dim=-1, dtype=values.dtype)
    else:
        raise ValueError(f"unknown expert scoring {scoring!r}; known: {', '.join(SCORINGS)}.")
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights.float(), ids


def apply_activation(gate_up: torch.Tensor, activation: str, alpha: float = 1.702,
                     limit: float | None = None) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> [..., I] in the input's dtype: the reference of `activation`
    (`aserve.kernels.activation`: silu, gelu_tanh, or gpt-oss' clamped swiglu_oai)."""
    if activation == "silu":
        return silu_and_mul_ref(gate_up)
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul_ref(gate_up)
    if activation == "swiglu_oai":
        return swiglu_oai_and_mul_ref(gate_up, alpha, limit)
    raise ValueError(f"unknown expert activation {activation!r}; known: "
                     f"{', '.join(ACTIVATIONS)}.")


def local_slots(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """[T, k] global expert ids -> [T, k] local indices (-1: held by another rank)."""
    if expert_map is None:
        return topk_ids.long()
    return expert_map.to(topk_ids.device).long()[topk_ids.long()]


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                  alpha: float = 1.702, limit: float | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k]
    (global ids; `expert_map` [E_global] -> local index or -1) -> [T, H] in x's dtype.

    Experts run in id order, each once over the rows routed to it (ordered by slot, then
    token), and add their weighted rows into a float32 sum that starts at zero: transformers'
    eager experts, bit for bit in float32.
    """
    local = local_slots(topk_ids, expert_map)  # [T, k]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in torch.unique(local[local >= 0]).tolist():
        slot, token = torch.where(local.T == e)  # by slot, then token (HF's row order)
        h = F.linear(x[token], w13[e], None if w13_bias is None else w13_bias[e])  # [n, 2I]
        h = apply_activation(h, activation, alpha, limit)  # [n, I]
        y = F.linear(h, w2[e], None if w2_bias is None else w2_bias[e])  # [n, H]
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(x.dtype)  # [T, H]
