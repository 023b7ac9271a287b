"""RMSNorm with an optional fused residual add, numerically matching HF's LlamaRMSNorm:
`weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(input_dtype)`."""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels import cpu_fused


class RMSNorm(nn.Module):
    """Normalises the last dim. `forward(x)` -> y; `forward(x, residual)` -> (y, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if cpu_fused.usable(x) and x.is_contiguous() and (
                residual is None or residual.is_contiguous()):
            return self._fused(x, residual)
        if residual is None:
            return self._norm(x)
        x = residual + x  # [T, hidden], in the model dtype as HF adds it
        return self._norm(x), x

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One C++ pass (CPU bf16); with a residual, x and residual are updated in place."""
        if residual is None:
            out = x.clone()  # x is also the caller's residual: leave it as it is
            cpu_fused.rms_norm(out, self.weight, self.eps)
            return out
        cpu_fused.rms_norm(x, self.weight, self.eps, residual)
        return x, residual
