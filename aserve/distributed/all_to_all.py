"""All-to-all exchanges of rows: the expert-parallel dispatch and combine (each rank's tokens
travel to the ranks holding their experts and their outputs travel back: the combine mode for
tokens split across ranks, where an all-reduce of replicated tokens does not apply), and the
row exchange and gather that sequence parallelism's attention (`aserve/layers/ulysses.py`) and
logits also use.

```
rank 0 tokens a b   slots (a,e1) (a,e4) (b,e2) (b,e5)      experts 0-3 on rank 0, 4-7 on rank 1
  1. counts:  rank 0 -> [2 to rank 0, 2 to rank 1]         (all_to_all_single of [ep] counts)
  2. dispatch: rows a, b -> rank 0 (e1, e2);  a, b -> rank 1 (e4, e5)   with ids and weights
  3. each rank runs its experts over what it received, one slot per row (weighted)
  4. combine: the rows go back the way they came; a token's slots are summed in expert order
```

Counts are exchanged first, so splits may be uneven (a rank may send or receive nothing). The
sum in expert-id order, in float32 from zero, is the one a single rank computes
(`fused_moe_ref`), so the layout changes no float32 result but through its GEMMs' row grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from aserve.distributed.state import expert_range, get_ep_group, get_ep_size

# runs this rank's experts: (rows [n, H], weights [n, 1] float32, ids [n, 1]) -> [n, H]
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def expert_owners(num_experts: int, device: torch.device) -> torch.Tensor:
    """[num_experts] int64: the EP rank holding each expert."""
    owners = [rank for rank in range(get_ep_size()) for _ in expert_range(num_experts, rank)]
    return torch.tensor(owners, dtype=torch.int64, device=device)


def exchange_rows(tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                  group: Any) -> torch.Tensor:
    """Rows of `tensor` (grouped by destination, send_counts[r] for rank r of `group`) to their
    ranks; returns the rows received, grouped by source."""
    out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=group)
    return out


def all_gather_rows(rows: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """Every rank's `rows` (rank r of `group` holds counts[r] of them), concatenated in rank
    order; `rows` itself for a group of one rank (None)."""
    if group is None or len(counts) == 1:
        return rows
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


def all_to_all_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   owners: torch.Tensor, local_experts: LocalExperts) -> torch.Tensor:
    """This rank's tokens x [t, H] with their routing [t, k] -> the full MoE output [t, H] (x's
    dtype), each (token, slot) computed on the rank holding its expert."""
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1)  # [t * k]
    dest = owners[ids]  # [t * k]
    order = torch.argsort(dest, stable=True)  # slots grouped by destination rank
    send = torch.bincount(dest, minlength=get_ep_size())  # [ep]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=get_ep_group())
    send_counts, recv_counts = send.tolist(), recv.tolist()
    group = get_ep_group()
    rows = exchange_rows(x[order // top_k], send_counts, recv_counts, group)  # [n, H]
    rows_ids = exchange_rows(ids[order], send_counts, recv_counts, group)  # [n]
    rows_w = exchange_rows(topk_weights.reshape(-1)[order].float(), send_counts, recv_counts,
                           group)
    y = local_experts(rows, rows_w[:, None], rows_ids[:, None])  # [n, H], weighted
    back = exchange_rows(y, recv_counts, send_counts, group)  # [t * k, H], in `order`
    slots = torch.empty_like(back)
    slots[order] = back
    slots = slots.view(num_tokens, top_k, x.shape[-1]).float()  # [t, k, H]
    by_expert = torch.argsort(topk_ids, dim=-1, stable=True)  # sum in expert-id order
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    for j in range(top_k):
        out += slots.gather(1, by_expert[:, j, None, None].expand(-1, 1, x.shape[-1]))[:, 0]
    return out.to(x.dtype)
