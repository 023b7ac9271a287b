"""RMSNorm with an optional fused residual add, numerically matching HF's LlamaRMSNorm:
`weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(input_dtype)`."""

from __future__ import annotations

import torch
from torch import nn

from aserve.backends.fused import rms_norm_op


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
        op = rms_norm_op(x)
        if op is not None and x.is_contiguous() and (
                residual is None or residual.is_contiguous()):
            return self._fused(op, x, residual)
        if residual is None:
            return self._norm(x)
        x = residual + x  # [T, hidden], in the model dtype as HF adds it
        return self._norm(x), x

    def _fused(self, op, x: torch.Tensor, residual: torch.Tensor | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One fused pass (C++ on CPU, Triton on GPUs); with a residual, x and residual are
        updated in place."""
        if residual is None:
            out = x.clone()  # x is also the caller's residual: leave it as it is
            op(out, self.weight, self.eps, None)
            return out
        op(x, self.weight, self.eps, residual)
        return x, residual
