"""Rotary position embedding (neox / rotate-half style) with HF-compatible frequency scaling.

Supported rope types: default, linear, dynamic (equal to default within
max_position_embeddings, the only range aserve serves), llama3, yarn. The inverse frequencies
follow `transformers.modeling_rope_utils`; cos/sin are computed once in float32 for every
position, times the attention factor (yarn's mscale), then cast to the model dtype, as HF does.

```
x = [x1 | x2 | pass]        x1, x2: rotary_dim / 2 each; pass: head_dim - rotary_dim
out = [x1*cos - x2*sin | x2*cos + x1*sin | pass]
```
"""

from __future__ import annotations

import math
from typing import Any

import torch

from aserve.layers.bind import OpsLayer


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, max_position: int, p: dict[str, Any]
          ) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(rotary_dim: int, base: float, max_position: int,
                  rope_scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] float32, attention factor) for a rope config."""
    p = dict(rope_scaling or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / p["factor"], 1.0
    if rope_type == "llama3":
        p.setdefault("original_max_position_embeddings", max_position)
        return _llama3_inv_freq(_base_inv_freq(base, rotary_dim), p), 1.0
    if rope_type == "yarn":
        return _yarn(base, rotary_dim, max_position, p)
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, linear, "
                     "dynamic, llama3, yarn.")


class RotaryEmbedding(OpsLayer):
    """Applies RoPE to q [T, Hq*D] and k [T, Hkv*D] (or [T, H, D]) at the given positions, in
    place, through the bound `ops.rope` (its reference: `rotary_ref`, the formula above)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, max_position, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float32)  # [P]
        freqs = positions[:, None] * inv_freq.to(positions.device)  # [P, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rotary_dim]
        self.register_buffer("cos_cache", (emb.cos() * attention_factor).to(dtype),
                             persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * attention_factor).to(dtype),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.rope(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim,
                      self.rotary_dim)
        return q, k  # rotated in place


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: dict[str, Any] | None, dtype: torch.dtype) -> RotaryEmbedding:
    """Build the rotary embedding for a rope config (`rope_type` or legacy `type` key)."""
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, rope_scaling, dtype)
