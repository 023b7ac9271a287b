"""The gated activations' torch references, each written once: the ops' defaults on every
platform (`backends.ops.KernelOps`), the oracle of the C++ ones (`cpu_elementwise`), and the
experts' activation of `fused_moe_ref` (`moe.apply_activation`).

```
x = [gate | up]                 gate, up: [..., d] each
silu_and_mul:        silu(gate) * up
gelu_tanh_and_mul:   gelu(gate, approximate="tanh") * up          (Gemma's gate)
swiglu_oai_and_mul:  gate <- min(gate, limit); up <- clamp(up, -limit, limit)   (gpt-oss)
                     (up + 1) * (gate * sigmoid(alpha * gate))
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d] in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d] in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai_and_mul_ref(x: torch.Tensor, alpha: float = 1.702,
                           limit: float | None = None) -> torch.Tensor:
    """[..., 2d] -> [..., d] in x's dtype; no clamp where `limit` is None."""
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
