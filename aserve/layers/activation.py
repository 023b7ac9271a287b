"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.layers.bind import OpsLayer


class SiluAndMul(OpsLayer):
    """[..., 2 * d] packed as [gate | up] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[..., 2 * d] packed as [gate | up] -> gelu_tanh(gate) * up, [..., d]: HF's
    `gelu_pytorch_tanh` gate (Gemma). Plain torch: no platform kernel fuses it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
