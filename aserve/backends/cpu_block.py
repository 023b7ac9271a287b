"""The CPU bf16 platform's whole-decoder-layer calls (`KernelOps.decoder_layer`,
`decoder_stack`): a pre-norm decoder layer as one C++ call (`kernels.cpu_decoder_layer`) where
every op it would call runs aserve's CPU bf16 kernels: the packed GEMMs (the MLP's gate_up
packed gated; a GPTQ act-order weight's inputs gathered first, as its module does), the fused
RMSNorm and RoPE, the row-tile attention over the paged cache. Same
kernels, same order, same tensors: outputs bit-identical to the module-by-module forward,
without the Python between the ops; and a stage's layers as one call.

`CpuDecoderBlock.of(layer)` reads a pre-norm layer's modules (the form in `backends.ops`) into
`DecoderLayerWeights` and says whether they qualify (None otherwise: a MoE block, attention
sinks or heads exchanged between ranks, weights not packed by aserve's GEMM, tensor
parallelism, q/k norms, a bias on gate_up, a head size the attention kernel does not take,
mixed norm eps); calling the block runs a step, or returns None for a step it does not cover (a
prompt chunk long enough for SDPA), which the layer then runs module by module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aserve.backends.ops import PackedLinear
from aserve.kernels import cpu_decoder_layer, cpu_extension
from aserve.kernels.cpu_attention import RowPlan
from aserve.kernels.cpu_gemm import PackedWeight
from aserve.kernels.cpu_qgemm import QuantPackedWeight

_NONE = torch.empty(0, dtype=torch.bfloat16)  # an absent bias; the first layer's residual
_NO_PERM = torch.empty(0, dtype=torch.int64)  # a linear without act-order


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer as plain tensors (the computation: `backends.ops`)."""

    input_norm: torch.Tensor
    input_norm_eps: float
    post_norm: torch.Tensor
    post_norm_eps: float
    qkv: PackedLinear | None  # what `pack_linears` returned (None: not packed)
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
    kv_group: int  # whose block table and slot mapping the layer reads
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    tp_size: int  # > 1: the row-parallel outputs need an all-reduce

    @classmethod
    def of(cls, layer: nn.Module) -> DecoderLayerWeights | None:
        """A pre-norm layer's tensors (its KV cache bound), or None where it has no dense MLP
        or no cache, attention sinks, or attention that exchanges heads between ranks."""
        self_attn, mlp = layer.self_attn, layer.mlp
        attn, rotary = self_attn.attn, self_attn.rotary_emb
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if (attn.kv_cache is None or gate_up is None or down is None
                or self_attn.sinks is not None or attn.exchanges_heads):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        qkv, o = self_attn.qkv_proj, self_attn.o_proj
        return cls(
            input_norm=norms[0].weight.data, input_norm_eps=norms[0].eps,
            post_norm=norms[1].weight.data, post_norm_eps=norms[1].eps,
            qkv=qkv.packed_weight, qkv_bias=_data(qkv.bias),
            q_norm=None if self_attn.q_norm is None else self_attn.q_norm.weight.data,
            k_norm=None if self_attn.k_norm is None else self_attn.k_norm.weight.data,
            o=o.packed_weight, o_bias=_data(o.bias),
            gate_up=gate_up.packed_weight, gate_up_bias=_data(gate_up.bias),
            down=down.packed_weight, down_bias=_data(down.bias),
            cos=rotary.cos_cache, sin=rotary.sin_cache, rotary_dim=rotary.rotary_dim,
            k_cache=attn.kv_cache[0], v_cache=attn.kv_cache[1], kv_group=attn.kv_group,
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            scale=attn.scale, sliding_window=attn.sliding_window, soft_cap=attn.soft_cap,
            tp_size=qkv.tp_size)

    def qualifies(self) -> bool:
        """Whether the C++ layer computes exactly what these modules do."""
        packed = (self.qkv, self.o, self.gate_up, self.down)
        return (all(isinstance(p, PackedWeight | QuantPackedWeight) for p in packed)
                and cpu_extension.load().rows_supported(  # its attention (AVX-512 or AVX2)
                    torch.empty(1, 1, self.head_dim, dtype=torch.bfloat16))
                and [p.gated for p in packed] == [False, False, True, False]
                and self.tp_size == 1 and self.q_norm is None and self.k_norm is None
                and self.gate_up_bias is None
                and self.k_cache.dtype == torch.bfloat16 and self.cos.dtype == torch.bfloat16
                and self.input_norm.dtype == torch.bfloat16
                and self.post_norm.dtype == torch.bfloat16
                and self.head_dim % 16 == 0 and self.head_dim <= 256
                and self.input_norm_eps == self.post_norm_eps)


def _data(param: nn.Parameter | None) -> torch.Tensor | None:
    return None if param is None else param.data


class CpuDecoderBlock:
    def __init__(self, weights: list[torch.Tensor], sizes: list[int], eps: float, scale: float,
                 soft_cap: float, kv_group: int) -> None:
        assert len(weights) == len(cpu_decoder_layer.WEIGHTS)
        assert len(sizes) == len(cpu_decoder_layer.SIZES) - 1  # rows: per step
        self.weights, self.sizes = weights, sizes
        self.eps, self.scale, self.soft_cap = eps, scale, soft_cap
        self.kv_group = kv_group
        self.module = cpu_extension.load()

    @classmethod
    def of(cls, layer: nn.Module) -> CpuDecoderBlock | None:
        """The block of one pre-norm layer (weights packed, KV cache bound), or None where it
        does not qualify."""
        w = DecoderLayerWeights.of(layer)
        if w is None or not w.qualifies():
            return None

        def bias(b: torch.Tensor | None) -> torch.Tensor:
            return _NONE if b is None else b

        def perm(p: PackedWeight | QuantPackedWeight) -> torch.Tensor:
            order = getattr(p, "perm", None)  # (act-order: the packed columns' inputs)
            return _NO_PERM if order is None else order.to(torch.int64).contiguous()

        weights = [w.input_norm, w.post_norm, w.qkv.data, bias(w.qkv_bias), w.o.data,
                   bias(w.o_bias), w.gate_up.data, w.down.data, bias(w.down_bias), w.cos, w.sin,
                   w.k_cache, w.v_cache, perm(w.qkv), perm(w.o), perm(w.gate_up), perm(w.down)]
        sizes = [w.qkv.out_features, w.o.out_features, w.gate_up.out_features,
                 w.down.out_features, w.num_heads, w.num_kv_heads, w.head_dim, w.rotary_dim,
                 w.sliding_window or 0]
        return cls(weights, sizes, w.input_norm_eps, w.scale, w.soft_cap or 0.0, w.kv_group)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the layer, as its modules compute them; None where this
        step has a chunk for SDPA (the layer then runs its modules)."""
        plan = _step_plan(positions, hidden, metadata.for_group(self.kv_group))
        if plan is None:
            return None
        out, residual = self.module.decoder_layer(
            hidden, _NONE if residual is None else residual, positions, self.weights,
            [plan.block_table, plan.tiles, plan.slot_mapping], self.sizes + [plan.starts[-1]],
            self.eps, self.scale, self.soft_cap)
        return out, residual


class CpuDecoderStack:
    """Consecutive layers' blocks bound once in C++ (`DecoderStack` in
    `kernels/csrc/decoder_layer.h`): a step runs every layer in one call, without the Python
    and argument conversion between layers (`benchmarks/studies/decoder_stack.py`;
    docs/benchmarks/serving-latency.md, "The decoder stack as one call").
    The layers share one KV cache group (one plan a step); each keeps its own weights, cache,
    window, eps, scale and soft-cap."""

    def __init__(self, blocks: list[CpuDecoderBlock]) -> None:
        self.kv_group = blocks[0].kv_group
        self.stack = blocks[0].module.DecoderStack(
            [b.weights for b in blocks], [b.sizes for b in blocks], [b.eps for b in blocks],
            [b.scale for b in blocks], [b.soft_cap for b in blocks])

    @classmethod
    def of(cls, blocks: list) -> CpuDecoderStack | None:
        """The stack of these layers' calls, or None where any is not a CpuDecoderBlock or
        they read more than one KV cache group."""
        if not blocks or not all(isinstance(b, CpuDecoderBlock) for b in blocks):
            return None
        if len({b.kv_group for b in blocks}) != 1:
            return None
        return cls(blocks)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer, as the layers' blocks compute them one by
        one; None where this step has a chunk for SDPA (the layers' modules then run)."""
        plan = _step_plan(positions, hidden, metadata.for_group(self.kv_group))
        if plan is None:
            return None
        out, residual = self.stack.forward(
            hidden, _NONE if residual is None else residual, positions,
            [plan.block_table, plan.tiles, plan.slot_mapping], plan.starts[-1])
        return out, residual


def _step_plan(positions: torch.Tensor, hidden: torch.Tensor, metadata) -> RowPlan | None:
    """The step's row plan, or None where the C++ layer does not take this step: a chunk long
    enough for SDPA, or inputs not as it reads them."""
    plan = RowPlan.of(metadata)
    if (plan.long_reqs or positions.dtype != torch.int64 or hidden.dtype != torch.bfloat16
            or not hidden.is_contiguous()):
        return None
    return plan
