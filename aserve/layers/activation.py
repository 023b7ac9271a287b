"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import cpu_fused


class SiluAndMul(nn.Module):
    """[..., 2 * d] packed as [gate | up] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_fused.usable(x) and x.is_contiguous():
            return cpu_fused.silu_and_mul(x)  # one C++ pass (CPU bf16)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
