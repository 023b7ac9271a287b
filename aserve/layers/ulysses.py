"""Ulysses sequence-parallel attention: the step's tokens are split over the SP ranks for
everything but attention, and one all-to-all before and one after attention trade tokens for
heads, so that each rank attends over every token of the step for its share of the heads.

```
sp = 2, this TP rank's heads q0..q3 (kv k0 k1), the step's T tokens split into halves A | B
rank 0 holds tokens A, every head       rank 1 holds tokens B, every head
  q/k/v projected, normed and roped on the local tokens (local positions)
  all-to-all ──►  rank 0: tokens A B, heads q0 q1 (k0)    rank 1: tokens A B, heads q2 q3 (k1)
  store K/V and attend with the whole step's metadata (the unchanged paged kernels)
  all-to-all ──►  rank 0: tokens A, every head            rank 1: tokens B, every head
  o_proj on the local tokens
```

Rank r holds the step's rows [r * chunk, (r + 1) * chunk), chunk = ceil(T / sp) (the runner pads
the last slice: `aserve/runner/sequence_parallel.py`); the padding rows are cut before
attention, so they write no K/V and nothing reads them. With fewer KV heads (per TP rank) than
SP ranks, each KV head is sent to the `sp / num_kv_heads` ranks whose query heads use it: the
cache of every rank holds `max(1, num_kv_heads / sp)` heads. `UlyssesAttention` is an
`Attention` over its share of the heads, so the runner binds and sizes its KV cache as any
other.
"""

from __future__ import annotations

import torch

from aserve.distributed.all_to_all import exchange_rows
from aserve.distributed.state import get_sp_group, get_sp_rank, get_sp_size
from aserve.layers.attention import Attention, AttentionMetadata


def sp_head_split(num_heads: int, num_kv_heads: int, sp_size: int) -> tuple[int, int]:
    """(query heads, kv heads) of each SP rank, from a TP rank's `num_heads` / `num_kv_heads`;
    ValueError naming the constraint where they cannot be split."""
    if num_heads % sp_size:
        raise ValueError(f"--sequence-parallel-size {sp_size} must divide the attention heads "
                         f"of each tensor-parallel rank ({num_heads}).")
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        raise ValueError(f"--sequence-parallel-size {sp_size} and the kv heads of each "
                         f"tensor-parallel rank ({num_kv_heads}) must divide one another.")
    return num_heads // sp_size, max(1, num_kv_heads // sp_size)


class UlyssesAttention(Attention):
    """q [t, Hq*D], k/v [t, Hkv*D] of this rank's t tokens (a TP rank's heads) -> [t, Hq*D],
    attending over every token of the step. `num_heads` / `num_kv_heads` are the TP rank's;
    the attributes of `Attention` (and the KV cache) are this SP rank's share of them."""

    exchanges_heads = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> None:
        sp_size = get_sp_size()
        q_per_rank, kv_per_rank = sp_head_split(num_heads, num_kv_heads, sp_size)
        super().__init__(q_per_rank, kv_per_rank, head_dim, scale, sliding_window, soft_cap)
        self.sp_rank, self.sp_size = get_sp_rank(), sp_size
        self.num_local_kv_heads = num_kv_heads
        # [sp, kv_per_rank]: the local kv heads SP rank j attends with (its query heads' group)
        starts = [j * num_kv_heads // sp_size for j in range(sp_size)]
        self.register_buffer("kv_index", torch.tensor(
            [[s + i for i in range(kv_per_rank)] for s in starts]), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_metadata: AttentionMetadata, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`sinks`: None, or float32 [Hq] (the TP rank's heads); this rank uses its share."""
        sp, d = self.sp_size, self.head_dim
        num_local = q.shape[0]
        num_tokens = attn_metadata.slot_mapping.shape[0]  # the step's rows, on every rank
        q = q.view(num_local, sp, self.num_heads, d)  # [t, sp, Hq/sp, D]
        k = k.view(num_local, self.num_local_kv_heads, d)[:, self.kv_index]  # [t, sp, kv, D]
        v = v.view(num_local, self.num_local_kv_heads, d)[:, self.kv_index]  # [t, sp, kv, D]
        send = torch.cat([q, k, v], dim=2).transpose(0, 1)  # [sp, t, Hq/sp + 2 kv, D]
        counts = [num_local] * sp
        rows = exchange_rows(send.reshape(sp * num_local, -1, d), counts, counts,
                             get_sp_group())[:num_tokens]  # [T, Hq/sp + 2 kv, D], step order
        q_all, k_all, v_all = (x.contiguous() for x in rows.split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1))
        if sinks is not None:
            sinks = sinks[self.sp_rank * self.num_heads:(self.sp_rank + 1) * self.num_heads]
        out = super().forward(q_all, k_all, v_all, attn_metadata, sinks)  # [T, Hq/sp * D]
        padded = out.new_zeros(sp * num_local, out.shape[1])
        padded[:num_tokens] = out
        back = exchange_rows(padded, counts, counts, get_sp_group())  # [sp, t] by head share
        return back.view(sp, num_local, -1).transpose(0, 1).reshape(num_local, -1)


def make_attention(num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   sliding_window: int | None = None, soft_cap: float | None = None
                   ) -> Attention:
    """The attention core of a TP rank's heads: Ulysses under sequence parallelism."""
    cls = UlyssesAttention if get_sp_size() > 1 else Attention
    return cls(num_heads, num_kv_heads, head_dim, scale, sliding_window, soft_cap)
