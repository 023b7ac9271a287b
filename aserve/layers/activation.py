"""Gated activations."""

from __future__ import annotations

import torch

from aserve.layers.bind import OpsLayer


class SiluAndMul(OpsLayer):
    """[..., 2 * d] packed as [gate | up] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(OpsLayer):
    """[..., 2 * d] packed as [gate | up] -> gelu_tanh(gate) * up, [..., d]: HF's
    `gelu_pytorch_tanh` gate (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(x)
