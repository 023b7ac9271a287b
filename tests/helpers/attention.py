"""Ragged paged-attention batches and their dense float64 answer, for the kernel tests; a
step's `AttentionMetadata` from host lists (`build_metadata`)."""

from __future__ import annotations

import torch

from aserve.layers.attention import AttentionMetadata

# (q_len, seq_len) per request: a full prefill, decodes, chunks after cached context
MIXED = [(7, 7), (1, 9), (3, 20), (1, 1), (5, 17), (1, 33), (16, 40)]


def dense_attention(q, k, v, scale, window=None, soft_cap=None):
    """q [Lq, Hq, D] = last Lq of the Lk tokens whose keys are k/v [Lk, Hkv, D]; float64."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, Lq, Lk]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [Lq, Hq, D]


def make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
               seed=0):
    """Random K/V per request scattered into a paged cache through a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for _, s in reqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    width = max(need) + 1
    table = torch.full((len(reqs), width), -1, dtype=torch.int32)  # -1 past each need
    keys, values, queries = [], [], []
    for r, (q_len, seq_len) in enumerate(reqs):
        blocks = [perm.pop() for _ in range(need[r])]
        table[r, : need[r]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        for pos in range(seq_len):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
    starts = torch.tensor([0] + [q for q, _ in reqs], dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    q = torch.cat(queries).to(dtype)
    return q, k_cache.to(dtype), v_cache.to(dtype), starts, seq_lens, table, keys, values


def expected(q, starts, keys, values, scale, window=None, soft_cap=None):
    parts = []
    for r, (k, v) in enumerate(zip(keys, values, strict=True)):
        parts.append(dense_attention(q[starts[r]:starts[r + 1]], k, v, scale, window, soft_cap))
    return torch.cat(parts)


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu",
                   num_tokens: int | None = None) -> AttentionMetadata:
    """Metadata from host lists; tokens past sum(query_lens) up to num_tokens are padding."""
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    slots: list[int] = []
    for q_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slots += [-1] * ((num_tokens or len(slots)) - len(slots))
    width = max((len(b) for b in block_tables), default=0)
    table = [b + [0] * (width - len(b)) for b in block_tables]
    block_table = torch.tensor(table, dtype=torch.int32, device=device)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.reshape(len(table), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))
