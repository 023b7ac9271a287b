"""A Llama-family decoder layer as one C++ call (`kernels.cpu_layer.decoder_layer`) where every
op it would call runs aserve's CPU bf16 kernels: the packed GEMMs (the MLP's gate_up packed
gated), the fused RMSNorm and RoPE, the row-tile attention over the paged cache. Same kernels,
same order, same tensors: outputs bit-identical to the module-by-module forward, without the
Python between the ops.

`CpuDecoderBlock.of(layer)` says whether a layer qualifies (None otherwise: another device or
dtype, tensor parallelism, q/k norms, an MLP with a bias on gate_up, a head size the attention
kernel does not take) and collects its tensors once; calling the block runs a step, or returns
None for a step it does not cover (a prompt chunk long enough for SDPA), which the layer then
runs module by module.
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_extension, cpu_layer
from aserve.kernels.cpu_attention import RowPlan, cpu_attention_forward
from aserve.kernels.cpu_gemm import PackedWeight

ENABLED = True  # tests switch it off to compare with the module-by-module forward
_NONE = torch.empty(0, dtype=torch.bfloat16)  # an absent bias; the first layer's residual


class CpuDecoderBlock:
    def __init__(self, weights: list[torch.Tensor], sizes: list[int], eps: float, scale: float,
                 soft_cap: float) -> None:
        assert len(weights) == len(cpu_layer.WEIGHTS)
        assert len(sizes) == len(cpu_layer.SIZES) - 1  # rows: per step
        self.weights, self.sizes = weights, sizes
        self.eps, self.scale, self.soft_cap = eps, scale, soft_cap
        self.module = cpu_extension.load()

    @classmethod
    def of(cls, layer) -> CpuDecoderBlock | None:
        """The block of a bound `LlamaDecoderLayer` (its KV cache attached), or None."""
        attn_mod, mlp = layer.self_attn, layer.mlp
        attn, rotary = attn_mod.attn, attn_mod.rotary_emb
        linears = (attn_mod.qkv_proj, attn_mod.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [linear.packed_weight for linear in linears]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        # (packed weights exist only where the extension is built: nothing is built here)
        if not (ENABLED and all(isinstance(p, PackedWeight) for p in packed)
                and [p.gated for p in packed] == [False, False, True, False]
                and all(linear.tp_size == 1 for linear in linears)
                and attn_mod.q_norm is None and attn.kv_cache is not None
                and attn.ops.forward is cpu_attention_forward
                and attn.kv_cache.dtype == torch.bfloat16
                and attn.head_dim % 16 == 0 and attn.head_dim <= 256
                and rotary.cos_cache.dtype == torch.bfloat16
                and all(n.weight.dtype == torch.bfloat16 for n in norms)
                and norms[0].eps == norms[1].eps):
            return None

        def bias(linear) -> torch.Tensor:
            return _NONE if linear.bias is None else linear.bias.data

        qkv, o, gate_up, down = linears
        weights = [norms[0].weight.data, norms[1].weight.data, packed[0].data, bias(qkv),
                   packed[1].data, bias(o), packed[2].data, packed[3].data, bias(down),
                   rotary.cos_cache, rotary.sin_cache, attn.kv_cache[0], attn.kv_cache[1]]
        sizes = [p.out_features for p in packed] + [
            attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.rotary_dim,
            attn.sliding_window or 0]
        return cls(weights, sizes, norms[0].eps, attn.scale, attn.soft_cap or 0.0)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, metadata
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the layer, as `LlamaDecoderLayer.forward`; None where this
        step has a chunk for SDPA (the layer then runs its modules)."""
        plan = RowPlan.of(metadata)
        if (plan.long_reqs or positions.dtype != torch.int64 or hidden.dtype != torch.bfloat16
                or not hidden.is_contiguous()):
            return None
        out, residual = self.module.decoder_layer(
            hidden, _NONE if residual is None else residual, positions, self.weights,
            [plan.block_table, plan.tiles, plan.slot_mapping], self.sizes + [plan.starts[-1]],
            self.eps, self.scale, self.soft_cap)
        return out, residual
