"""`KernelOps`: every kernel a model's layers run, chosen once per (platform, dtype).

A platform's `kernel_ops(dtype)` returns one frozen `KernelOps`; the runner binds it to the
model after loading (`aserve.layers.bind_ops`), and every layer calls its kernels through
`self.ops`. Layers and models never look at a tensor's device or dtype to pick a kernel, and
import no device kernel: they see only this interface. `REF_OPS` holds the torch references,
the float32 path that matches transformers bit for bit and the oracle of every kernel test; a
layer not bound yet runs them.

Each op has one calling convention whatever implements it:

    store_kv(key, value, k_cache, v_cache, slot_mapping)            K/V rows into their slots
    paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale,
                    sliding_window, soft_cap, *, query_start_loc_cpu, seq_lens_cpu, key, value,
                    sinks=None)
    attention_forward(q, k, v, k_cache, v_cache, metadata, scale, sliding_window, soft_cap, *,
                      sinks=None)
                    optional: store + attend in one go (None: the two calls above)
                    sinks: None, or float32 [Hq] (this rank's query heads): gpt-oss's attention
                    sinks, one logit per head in every row's softmax with no value
                    (`paged_attention_ref`); None costs nothing
    rms_norm(x, weight, eps, residual)      in place: x <- norm(x); or residual += x,
                                            x <- norm(residual)
    rope(positions, q, k, cos, sin, head_dim, rotary_dim)      neox RoPE on q and k, in place
    silu_and_mul(x) -> silu(x[..., :d]) * x[..., d:]
    gelu_tanh_and_mul(x) -> gelu(x[..., :d], approximate="tanh") * x[..., d:]
    argmax(logits) -> logits.argmax(-1)        (ties: the lowest id)
    random_sampling: "race" | "inverse_cdf"   how the sampler draws a random row's token from
                    its probabilities: the exponential race argmax(p / E), V draws a row (fast
                    elementwise on a GPU), or one uniform a row against a float64 cumsum
                    (a CPU's exponential_ costs ~15 ns an element: 24 ms for 32 x 49k)
    top_p_candidates: int   0: top_p sorts each row's whole vocabulary; k > 0: it looks
                    among the k best tokens first and sorts only rows whose nucleus is not
                    within them (a host sync, free on the CPU; a sort there costs ~50 ms for
                    32 x 49k)
    pack_linears([(weight, gated), ...]) -> [PackedLinear | None, ...]
                    optional: weights in the platform's GEMM layout, packed once after loading
                    (None: every linear is F.linear on the loaded weight)
    decoder_layer(DecoderLayerWeights) -> DecoderLayerFn | None
                    optional: a whole pre-norm decoder layer as one call, where the platform
                    has one for these weights (None: module by module)
    decoder_stack([DecoderLayerFn, ...]) -> DecoderLayerFn | None
                    optional: consecutive layers' `decoder_layer` results (one KV cache
                    group) as one call, same signature as one layer's (None: layer by layer)
    select_experts(router_logits, top_k, *, scoring, renormalize, weights_dtype)
                    -> (weights [T, k] float32, ids [T, k]): a MoE router's choice
    fused_moe(ExpertWeights) -> FusedMoEFn
                    a MoE layer's experts, prepared once after loading (packed where the
                    platform packs); the result runs (x, topk_weights, topk_ids) -> [T, H]:
                    each token's top-k experts, weighted and summed (`fused_moe_ref`)

Which implementation each platform picks, by dtype, is the table in docs/design.md ("Kernel
selection"): `cpu_ops.py` for the CPU, `triton_ops.py` for CUDA / ROCm; XLA runs `REF_OPS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from aserve.kernels.moe import fused_moe_ref, select_experts
from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.rms_norm import rms_norm_ref
from aserve.kernels.rotary import rotary_ref
from aserve.kernels.store_kv import store_kv_ref


class PackedLinear(Protocol):
    """A weight [N, K] in a platform's GEMM layout (the loaded weight is then dropped)."""

    gated: bool  # [gate; up] packed so that `silu_and_mul` comes out of the GEMM

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> x W^T (+ bias), [..., N], in x's dtype."""

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        """`linear(x).float()` (the LM head's logits)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A gated weight only: silu(x gate^T) * (x up^T), [..., N / 2]."""


class DecoderLayerFn(Protocol):
    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata: object
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the layer, as the layer's modules compute them; None for a
        step this fast path does not cover (the layer then runs its modules)."""


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer as plain tensors, filled by the model for `decoder_layer`:

        residual += hidden; x = input_norm(residual)          (first layer: residual = hidden)
        q, k, v = x Wqkv^T (+ b); q, k = q_norm/k_norm (if any), RoPE; store k, v; attend
        residual += attn Wo^T (+ b); x = post_norm(residual)
        hidden = (silu(x Wgate^T) * x Wup^T) Wdown^T (+ b)

    `qkv`, `o`, `gate_up`, `down` are what `pack_linears` returned (None: not packed). There are
    no attention sinks here: a layer with sinks must not ask for `decoder_layer`.
    """

    input_norm: torch.Tensor
    input_norm_eps: float
    post_norm: torch.Tensor
    post_norm_eps: float
    qkv: PackedLinear | None
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: PackedLinear | None
    o_bias: torch.Tensor | None
    gate_up: PackedLinear | None
    gate_up_bias: torch.Tensor | None
    down: PackedLinear | None
    down_bias: torch.Tensor | None
    cos: torch.Tensor  # [max_positions, rotary_dim]
    sin: torch.Tensor
    rotary_dim: int
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    tp_size: int  # > 1: the row-parallel outputs need an all-reduce


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's experts on this rank, for `fused_moe` (layout: `aserve.kernels.moe`).

    Under expert parallelism `w13` / `w2` hold this rank's experts only and `expert_map` maps a
    global expert id to its local index (-1: another rank's); under tensor parallelism each
    expert's intermediate size is this rank's share.
    """

    w13: torch.Tensor  # [E_local, 2I, H]: [gate; up] rows per expert
    w2: torch.Tensor  # [E_local, H, I]
    w13_bias: torch.Tensor | None = None  # [E_local, 2I]
    w2_bias: torch.Tensor | None = None  # [E_local, H] (None on all but one rank under TP)
    activation: str = "silu"  # silu | gelu_tanh | swiglu_oai (`kernels.moe.apply_activation`)
    alpha: float = 1.702  # swiglu_oai: gate * sigmoid(alpha * gate)
    limit: float | None = None  # swiglu_oai: the clamp
    expert_map: torch.Tensor | None = None  # [E_global] int32; None: every expert is local


class FusedMoEFn(Protocol):
    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] float32, topk_ids [T, k] global ids -> [T, H] in
        x's dtype: this rank's experts' share of each token's weighted sum."""


def fused_moe_ref_fn(w: ExpertWeights) -> FusedMoEFn:
    """`fused_moe_ref` over `w`'s tensors (nothing to prepare)."""
    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe_ref(x, w.w13, w.w2, topk_weights, topk_ids, activation=w.activation,
                             w13_bias=w.w13_bias, w2_bias=w.w2_bias, expert_map=w.expert_map,
                             alpha=w.alpha, limit=w.limit)
    return run


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class KernelOps:
    """The kernels of one platform for one activation dtype (see the module docstring)."""

    name: str  # e.g. "cpu-bf16", "triton", "ref": for logs and tests
    store_kv: Callable[..., None] = store_kv_ref
    paged_attention: Callable[..., torch.Tensor] = paged_attention_ref
    attention_forward: Callable[..., torch.Tensor] | None = None
    rms_norm: Callable[..., None] = rms_norm_ref
    rope: Callable[..., None] = rotary_ref
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul_ref
    argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_ref
    random_sampling: str = "race"
    top_p_candidates: int = 0
    pack_linears: Callable[[Sequence[tuple[torch.Tensor, bool]]],
                           list[PackedLinear | None]] | None = None
    decoder_layer: Callable[[DecoderLayerWeights], DecoderLayerFn | None] | None = None
    decoder_stack: Callable[[Sequence[DecoderLayerFn]], DecoderLayerFn | None] | None = None
    select_experts: Callable[..., tuple[torch.Tensor, torch.Tensor]] = select_experts
    fused_moe: Callable[[ExpertWeights], FusedMoEFn] = fused_moe_ref_fn


REF_OPS = KernelOps("ref")
"""The torch references: float32 on any device, XLA, and layers not bound to a platform yet."""
