"""The CPU bf16 platform's whole-decoder-layer fast path (`KernelOps.decoder_layer`): a pre-norm
decoder layer as one C++ call (`kernels.cpu_decoder_layer.decoder_layer`) where every op it
would call runs aserve's CPU bf16 kernels: the packed GEMMs (the MLP's gate_up packed gated),
the fused RMSNorm and RoPE, the row-tile attention over the paged cache. Same kernels, same
order, same tensors: outputs bit-identical to the module-by-module forward, without the Python
between the ops (~80 us per layer).

`CpuDecoderBlock.of(weights)` takes the `DecoderLayerWeights` a model fills and says whether
they qualify (None otherwise: weights not packed by aserve's GEMM, tensor parallelism, q/k
norms, a bias on gate_up, a head size the attention kernel does not take, mixed norm eps);
calling the block runs a step, or returns None for a step it does not cover (a prompt chunk
long enough for SDPA), which the layer then runs module by module.
"""

from __future__ import annotations

import torch

from aserve.backends.ops import DecoderLayerWeights
from aserve.kernels import cpu_decoder_layer, cpu_extension
from aserve.kernels.cpu_attention import RowPlan
from aserve.kernels.cpu_gemm import PackedWeight

_NONE = torch.empty(0, dtype=torch.bfloat16)  # an absent bias; the first layer's residual


def _qualifies(w: DecoderLayerWeights) -> bool:
    packed = (w.qkv, w.o, w.gate_up, w.down)
    return (all(isinstance(p, PackedWeight) for p in packed)
            and [p.gated for p in packed] == [False, False, True, False]
            and w.tp_size == 1 and w.q_norm is None and w.k_norm is None
            and w.gate_up_bias is None
            and w.k_cache.dtype == torch.bfloat16 and w.cos.dtype == torch.bfloat16
            and w.input_norm.dtype == torch.bfloat16 and w.post_norm.dtype == torch.bfloat16
            and w.head_dim % 16 == 0 and w.head_dim <= 256
            and w.input_norm_eps == w.post_norm_eps)


class CpuDecoderBlock:
    def __init__(self, weights: list[torch.Tensor], sizes: list[int], eps: float, scale: float,
                 soft_cap: float) -> None:
        assert len(weights) == len(cpu_decoder_layer.WEIGHTS)
        assert len(sizes) == len(cpu_decoder_layer.SIZES) - 1  # rows: per step
        self.weights, self.sizes = weights, sizes
        self.eps, self.scale, self.soft_cap = eps, scale, soft_cap
        self.module = cpu_extension.load()

    @classmethod
    def of(cls, w: DecoderLayerWeights) -> CpuDecoderBlock | None:
        """The block of one layer's weights (its KV cache bound), or None where they do not
        qualify."""
        if not _qualifies(w):
            return None

        def bias(b: torch.Tensor | None) -> torch.Tensor:
            return _NONE if b is None else b

        weights = [w.input_norm, w.post_norm, w.qkv.data, bias(w.qkv_bias), w.o.data,
                   bias(w.o_bias), w.gate_up.data, w.down.data, bias(w.down_bias), w.cos, w.sin,
                   w.k_cache, w.v_cache]
        sizes = [w.qkv.out_features, w.o.out_features, w.gate_up.out_features,
                 w.down.out_features, w.num_heads, w.num_kv_heads, w.head_dim, w.rotary_dim,
                 w.sliding_window or 0]
        return cls(weights, sizes, w.input_norm_eps, w.scale, w.soft_cap or 0.0)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the layer, as its modules compute them; None where this
        step has a chunk for SDPA (the layer then runs its modules)."""
        plan = _step_plan(positions, hidden, metadata)
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
    and argument conversion between layers (0.2-0.6 ms a decode step of smol's 30 layers,
    `benchmarks/decoder_stack.py`).
    The layers share one KV cache group (one plan a step); each keeps its own weights, cache,
    window, eps, scale and soft-cap."""

    def __init__(self, blocks: list[CpuDecoderBlock]) -> None:
        self.stack = blocks[0].module.DecoderStack(
            [b.weights for b in blocks], [b.sizes for b in blocks], [b.eps for b in blocks],
            [b.scale for b in blocks], [b.soft_cap for b in blocks])

    @classmethod
    def of(cls, blocks: list) -> CpuDecoderStack | None:
        """The stack of these layers' fast paths, or None where any is not a CpuDecoderBlock."""
        if not blocks or not all(isinstance(b, CpuDecoderBlock) for b in blocks):
            return None
        return cls(blocks)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer, as the layers' blocks compute them one by
        one; None where this step has a chunk for SDPA (the layers then run one by one)."""
        plan = _step_plan(positions, hidden, metadata)
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
