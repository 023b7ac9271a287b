"""RMSNorm with an optional fused residual add, numerically matching HF's LlamaRMSNorm:
`weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(input_dtype)`, through the bound
`ops.rms_norm` (in place; its reference `rms_norm_ref` is that formula); and Gemma's, which
scales by `1 + weight` in float32 before rounding (`GemmaRMSNorm`)."""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.bind import OpsLayer


class RMSNorm(OpsLayer):
    """Normalises the last dim. `forward(x)` -> y; `forward(x, residual)` -> (y, x + residual),
    where x and residual are updated in place (y is x)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            out = x.clone()  # x is also the caller's residual: leave it as it is
            self.ops.rms_norm(out, self.weight, self.eps, None)
            return out
        self.ops.rms_norm(x, self.weight, self.eps, residual)
        return x, residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, as HF's Gemma2RMSNorm / Gemma3RMSNorm compute it:
    `(x_fp32 * rsqrt(mean(x_fp32^2) + eps) * (1 + weight_fp32)).to(input_dtype)`.

    The checkpoint's weight is the offset from 1 (zeros: the identity scale). Plain torch: the
    rounding comes after the scale, which no `ops.rms_norm` kernel does; no residual fusion
    (Gemma adds the residual after its post-norms).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self._scale: torch.Tensor | None = None  # 1 + weight in float32, made at first use

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual), as `RMSNorm`."""
        if residual is not None:
            x = x + residual  # [..., hidden]
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self._scale is None:  # weights are loaded before any forward and never change
            self._scale = 1.0 + self.weight.float()
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self._scale).to(x.dtype)  # [..., hidden]
