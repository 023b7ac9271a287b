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
                    (the CPU's: its exponential_ is slow; docs/benchmarks/sampling.md)
    top_p_candidates: int   0: top_p sorts each row's whole vocabulary; k > 0: it looks
                    among the k best tokens first and sorts only rows whose nucleus is not
                    within them (a host sync, free on the CPU, where a sort of the whole
                    vocabulary is slow)
    pack_linears([LinearToPack(weight, gated, quantized), ...]) -> [PackedLinear | None, ...]
                    optional: weights in the platform's GEMM layout, packed once after loading
                    (None: every linear is F.linear on the loaded weight); `quantized` reads
                    the weight's integer form where the checkpoint was quantized
                    (`quantization.int_weights`), for a platform with integer kernels
    decoder_layer(layer) -> DecoderLayerFn | None
                    optional: a pre-norm decoder layer (below; weights packed, KV cache bound)
                    as one call, where the platform has one for it (None: module by module);
                    the platform reads the layer's modules itself
    decoder_stack([DecoderLayerFn, ...]) -> DecoderLayerFn | None
                    optional: consecutive layers' `decoder_layer` calls as one, same signature
                    as one layer's (None: layer by layer)
    select_experts(router_logits, top_k, *, scoring, renormalize, weights_dtype)
                    -> (weights [T, k] float32, ids [T, k]): a MoE router's choice
    fused_moe(ExpertWeights) -> FusedMoEFn
                    a MoE layer's experts, prepared once after loading (packed where the
                    platform packs); the result runs (x, topk_weights, topk_ids) -> [T, H]:
                    each token's top-k experts, weighted and summed (`fused_moe_ref`)

Which implementation each platform picks, by dtype, is the table in docs/design.md ("Kernel
selection"): `cpu_ops.py` for the CPU, `triton_ops.py` for CUDA / ROCm; XLA runs `REF_OPS`.

A pre-norm decoder layer, the form `decoder_layer` reads (the Llama family's; a model's stack
says its layers have it, `layers.decoder_stack.DecoderStack`):

    layer.input_layernorm, .post_attention_layernorm        RMSNorm (weight, eps)
    layer.self_attn: qkv_proj, q_norm | None, k_norm | None, rotary_emb, attn (the `Attention`:
                     heads, scale, window, soft-cap, KV cache and group), o_proj, sinks | None
    layer.mlp: gate_up_proj (gated) and down_proj where it is dense (a MoE block has neither)

    residual += hidden; x = input_layernorm(residual)     (first layer: residual = hidden)
    q, k, v = qkv_proj(x); q, k = q_norm/k_norm (if any), RoPE; store k, v; attend
    residual += o_proj(attn); x = post_attention_layernorm(residual)
    hidden = down_proj(silu(gate(x)) * up(x))                           -> (hidden, residual)

`fuse_layers` puts the two together for a stack's layers; `bind_ops` installs its answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from aserve.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from aserve.kernels.moe import fused_moe_ref, select_experts
from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.rms_norm import rms_norm_ref
from aserve.kernels.rotary import rotary_ref
from aserve.kernels.store_kv import store_kv_ref
from aserve.quantization.int_weights import IntWeight


class LinearToPack(NamedTuple):
    weight: torch.Tensor  # [N, K], as loaded (a quantized checkpoint's: dequantized)
    gated: bool  # [gate; up]: pack so that `silu_and_mul` comes out of the GEMM
    quantized: Callable[[], IntWeight | None] | None = None  # its integer form, read on call


class PackedLinear(Protocol):
    """A weight [N, K] in a platform's GEMM layout (the loaded weight is then dropped); one
    kept as integers says how in `quantization` (e.g. "int4 g32"; /v1/models reports it)."""

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
        """(hidden, residual) after the layer(s), as their modules compute them, from the step's
        metadata (each call reads its KV cache group's); None for a step this call does not
        cover (the modules then run)."""


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
    # a quantized checkpoint's experts as integers, read on call: per local expert its
    # [gate; up] and its down (`quantization.int_weights.experts`); None: float only
    quantized: Callable[[], tuple[list[IntWeight], list[IntWeight]] | None] | None = None


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
    pack_linears: Callable[[Sequence[LinearToPack]], list[PackedLinear | None]] | None = None
    decoder_layer: Callable[[nn.Module], DecoderLayerFn | None] | None = None
    decoder_stack: Callable[[Sequence[DecoderLayerFn]], DecoderLayerFn | None] | None = None
    select_experts: Callable[..., tuple[torch.Tensor, torch.Tensor]] = select_experts
    fused_moe: Callable[[ExpertWeights], FusedMoEFn] = fused_moe_ref_fn


REF_OPS = KernelOps("ref")
"""The torch references: float32 on any device, XLA, and layers not bound to a platform yet."""


def unfused(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
            metadata: object) -> None:
    """The fused form of layers the platform runs module by module: it covers no step."""
    return None


def fuse_layers(ops: KernelOps, layers: Sequence[nn.Module]) -> DecoderLayerFn:
    """Consecutive pre-norm decoder layers (the form above) as the platform's whole-layer calls
    (`FusedLayers`), or `unfused` where it has none."""
    return unfused if ops.decoder_layer is None or not layers else FusedLayers(ops, layers)


class FusedLayers:
    """A stack's layers through `ops.decoder_layer` / `ops.decoder_stack`, chosen at the first
    step after their KV caches are bound (and again after a rebinding: the runner binds every
    layer's cache together, after `bind_ops`): the stack as one call where every layer has a
    whole-layer call and the platform stacks them; else layer by layer, each layer's call where
    it has one and its modules where not; else none. A step that a call does not cover runs the
    modules instead (the stack's, all of them: None here)."""

    def __init__(self, ops: KernelOps, layers: Sequence[nn.Module]) -> None:
        self.ops, self.layers = ops, list(layers)
        self._attn = self.layers[0].self_attn.attn  # whose KV cache (re)binding we watch
        self._bound: torch.Tensor | None = None  # the KV cache of the current choice
        self._run: DecoderLayerFn = unfused  # no cache yet (memory profiling): the modules

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata: object
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._attn.kv_cache is not self._bound:
            self._bound = self._attn.kv_cache
            self._run = unfused if self._bound is None else self._choose()
        return self._run(positions, hidden, residual, metadata)

    def _choose(self) -> DecoderLayerFn:
        calls = [self.ops.decoder_layer(layer) for layer in self.layers]
        if None not in calls and self.ops.decoder_stack is not None:
            stack = self.ops.decoder_stack(calls)
            if stack is not None:
                return stack
        if all(call is None for call in calls):
            return unfused
        return _LayerByLayer(zip(calls, self.layers))


class _LayerByLayer:
    """Each layer's whole-layer call where it has one (and takes the step), else its modules."""

    def __init__(self, layers: Iterable[tuple[DecoderLayerFn | None, nn.Module]]) -> None:
        self.layers = list(layers)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata: object
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        for call, layer in self.layers:
            out = None if call is None else call(positions, hidden, residual, metadata)
            hidden, residual = layer(positions, hidden, residual, metadata) if out is None else out
        return hidden, residual
