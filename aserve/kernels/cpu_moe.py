"""Fused mixture-of-experts for CPUs with AVX512-BF16: a MoE layer's experts in one C++ call
over weights packed once with aserve's GEMM (`cpu_gemm`); the CPU bf16 `KernelOps.fused_moe`
(`backends/cpu_ops.py` builds it from an `ExpertWeights`).

`CpuFusedMoE(w13, w2, ...)` (the tensors and options of `fused_moe_ref`) packs every expert's
w13 gated (each panel pairs 24 gate rows with the same 24 up rows, so the GEMM's epilogue adds
the bias and applies the activation) and w2 plain, stacked per layer in one buffer of huge
pages where Linux grants one:

    w13  [E, ceil(I / 24), H / 2, 3, 16, 2]      gemm_pack(w13[e], gated=True) for each e
    w2   [E, ceil(H / 48), I / 2, 3, 16, 2]      gemm_pack(w2[e])

A call groups the T * k (token, slot) pairs by local expert, gathers their rows, runs the gated
and the down GEMM over (expert, panel) tasks on every core, then sums each token's weighted
rows in float32 (`csrc/moe.h`). Every step rounds where `fused_moe_ref` does and the sums run
in its order, so the result is bit-equal to looping experts through `PackedWeight` and the
element-wise activations, and differs from `fused_moe_ref` (oneDNN's GEMM) only as the two
GEMMs do, in the last bf16 bit of some values.

This is not the routing (`moe.select_experts`) nor a layer. It keeps no reference to the raw
expert weights (a layer may drop them once this is built), only to the biases and the expert
map. `supports(...)` is False where the kernel does not apply (no AVX512-BF16 build, H or I
odd, weights or biases not bf16 on the CPU).
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_extension, cpu_gemm
from aserve.kernels.moe import ACTIVATIONS

GATED_PANEL = cpu_gemm.PANEL // 2  # outputs per gated panel (24 gate + 24 up rows)


def _module():
    return cpu_extension.load()


def _packed_shape(num_experts: int, outputs: int, per_panel: int,
                  in_features: int) -> tuple[int, ...]:
    return (num_experts, -(-outputs // per_panel), in_features // 2, 3, 16, 2)


class CpuFusedMoE:
    """One MoE layer's experts in aserve's GEMM layout; `__call__` is a `FusedMoEFn`. It keeps
    packed copies only (`packed`: the layer may drop the loaded weights)."""

    packed = True

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, activation: str = "silu",
                 w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                 expert_map: torch.Tensor | None = None, alpha: float = 1.702,
                 limit: float | None = None) -> None:
        assert self.supports(w13, w2, w13_bias, w2_bias, activation), "supports() first"
        num_experts, two_i, self.hidden = w13.shape
        self.intermediate = two_i // 2
        shapes = (_packed_shape(num_experts, self.intermediate, GATED_PANEL, self.hidden),
                  _packed_shape(num_experts, self.hidden, cpu_gemm.PANEL, self.intermediate))
        self.w13, self.w2 = _empty_packed(shapes)
        for e in range(num_experts):  # one expert's pack at a time beside the stacks
            self.w13[e].copy_(_module().gemm_pack(w13[e], True))
            self.w2[e].copy_(_module().gemm_pack(w2[e], False))
        self.w13_bias = None if w13_bias is None else w13_bias.contiguous()  # [E, 2I]
        self.w2_bias = None if w2_bias is None else w2_bias.contiguous()  # [E, H]
        self.expert_map = (None if expert_map is None  # [E_global] int32
                           else expert_map.to(torch.int32).contiguous())
        self.activation, self.alpha = activation, float(alpha)
        self.limit = float("inf") if limit is None else float(limit)

    @staticmethod
    def supports(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, activation: str = "silu") -> bool:
        """Whether the kernel takes these experts (else `fused_moe_ref` does)."""
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2 != 0:
            return False
        num_experts, two_i, hidden = w13.shape
        biases = [b for b in (w13_bias, w2_bias) if b is not None]
        return (all(t.device.type == "cpu" and t.dtype == torch.bfloat16
                    for t in (w13, w2, *biases))
                and w2.shape == (num_experts, hidden, two_i // 2)
                and hidden % 2 == 0 and (two_i // 2) % 2 == 0 and num_experts > 0
                and (w13_bias is None or w13_bias.shape == (num_experts, two_i))
                and (w2_bias is None or w2_bias.shape == (num_experts, hidden))
                and activation in ACTIVATIONS and cpu_gemm.avx512())

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_weights [T, k], topk_ids [T, k] global ids -> [T, H] bf16."""
        return _module().fused_moe(
            x.contiguous(), self.w13, self.w2, self.w13_bias, self.w2_bias,
            topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int64).contiguous(),
            self.expert_map, self.intermediate, self.activation, self.alpha, self.limit)


def _empty_packed(shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """Empty bf16 tensors of these shapes, in one buffer of huge pages where Linux grants one
    (a decode step streams the experts it routes to from memory; see `gather_in_huge_pages`)."""
    numels = [torch.Size(s).numel() for s in shapes]
    got = cpu_gemm.empty_in_huge_pages([2 * n for n in numels])
    if got is None:
        return [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    return [v.view(torch.bfloat16).view(s) for v, s in zip(got[1], shapes, strict=True)]
