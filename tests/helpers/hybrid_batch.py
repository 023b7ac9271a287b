"""Ragged batches over a paged cache laid out as the hybrid KV cache leaves it, and the kernels
that run on them, for the sliding-window and attention-sink tests (tests/kernels).

The hybrid cache frees a request's blocks that lie wholly before the first key its first query
of the step sees (`p - W + 1`); their block-table entries then point at the null block (0) or
at a stale block reused by another request:

```
W = 5, block_size = 4, context = 13, chunk of 3 (positions 13..15): first key 9
  token:  0  1  2  3 |  4  5  6  7 |  8  9 10 11 | 12 13 14 15
  table:  0 (null)   |  stale       |  live       |  live
```

`make_batch` builds a batch (random K/V in shuffled live blocks, garbage everywhere else);
`hybridise` writes large garbage (or a poison such as NaN) into the out-of-window blocks and
re-points their entries; `run_cpu_op` / `triton_attention` run the platform kernels on a batch.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

GARBAGE = 1e4  # the null block's value; freed blocks get random values of this size


class Batch(NamedTuple):
    """A ragged batch over a paged cache; the caches already hold this step's K/V."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]; block 0 is the null block
    v_cache: torch.Tensor
    starts: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    table: torch.Tensor  # [R, M] int32, every needed entry a live block; 0 past the need
    keys: list[torch.Tensor]  # request r's [seq_len, Hkv, D]
    values: list[torch.Tensor]
    key: torch.Tensor  # [T, Hkv, D]: this step's rows, aligned with q
    value: torch.Tensor
    slots: torch.Tensor  # [T] int64: where this step's rows live


def _garbage(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * GARBAGE).clamp(-6e4, 6e4)  # finite in fp16


def make_batch(reqs: list[tuple[int, int]], head_dim: int, num_heads: int, num_kv_heads: int,
               block_size: int, dtype: torch.dtype = torch.float32, q_scale: float = 1.0,
               seed: int = 0) -> Batch:
    """Random K/V per request in shuffled live blocks; the null block and spare blocks hold
    garbage."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for _, s in reqs]
    live = (1 + 2 + torch.randperm(sum(need), generator=gen)).tolist()  # after null + 2 spare
    shape = (1 + 2 + sum(need), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _garbage(shape, gen), _garbage(shape, gen)
    k_cache[0] = v_cache[0] = GARBAGE
    table = torch.zeros(len(reqs), max(need) + 2, dtype=torch.int32)
    keys, values, queries, slots = [], [], [], []
    for r, (q_len, seq_len) in enumerate(reqs):
        blocks = [live.pop() for _ in range(need[r])]
        table[r, : need[r]] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slot = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        k_cache.view(-1, num_kv_heads, head_dim)[slot] = keys[r]
        v_cache.view(-1, num_kv_heads, head_dim)[slot] = values[r]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen) * q_scale)
        slots.append(slot[seq_len - q_len:])
    starts = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).int()
    keys = [k.to(dtype) for k in keys]
    values = [v.to(dtype) for v in values]
    return Batch(torch.cat(queries).to(dtype), k_cache.to(dtype), v_cache.to(dtype), starts,
                 torch.tensor([s for _, s in reqs], dtype=torch.int32), table, keys, values,
                 torch.cat([k[s - q:] for k, (q, s) in zip(keys, reqs, strict=True)]),
                 torch.cat([v[s - q:] for v, (q, s) in zip(values, reqs, strict=True)]),
                 torch.cat(slots))


def out_of_window_columns(batch: Batch, window: int | None) -> list[range]:
    """Per request, the block-table columns of blocks wholly before the first key that the
    step's first query (position seq_len - q_len) sees."""
    block_size = batch.k_cache.shape[1]
    starts, lens = batch.starts.tolist(), batch.seq_lens.tolist()
    if window is None:
        return [range(0) for _ in lens]
    return [range(max(0, lens[r] - (starts[r + 1] - starts[r]) - window + 1) // block_size)
            for r in range(len(lens))]


def hybridise(batch: Batch, window: int | None, poison: float | None = None,
              seed: int = 1) -> Batch:
    """The batch as the hybrid cache leaves it: every out-of-window block freed and filled with
    garbage (or `poison`, the null block too), its entry pointing in turn at the null block, at
    itself (stale), or at a live block of another request."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = batch.k_cache.clone(), batch.v_cache.clone(), batch.table.clone()
    lens, num_reqs = batch.seq_lens.tolist(), len(batch.keys)
    block_size = k_cache.shape[1]
    if poison is not None:
        k_cache[0] = v_cache[0] = poison
    for r, cols in enumerate(out_of_window_columns(batch, window)):
        for i, col in enumerate(cols):
            freed = int(table[r, col])
            for cache in (k_cache, v_cache):
                cache[freed] = (_garbage(cache.shape[1:], gen) if poison is None
                                else torch.full(cache.shape[1:], poison)).to(cache.dtype)
            other = (r + 1) % num_reqs  # its last block is always in its window
            table[r, col] = [0, freed, int(table[other, (lens[other] - 1) // block_size])][i % 3]
    return batch._replace(k_cache=k_cache, v_cache=v_cache, table=table)


def assert_hybrid_changes_something(batch: Batch, hybrid: Batch, window: int | None) -> None:
    """The garbage case is not vacuous: with a short window some entry was re-pointed."""
    if window is not None and window <= 16:
        assert not torch.equal(batch.table, hybrid.table)


def metadata(b: Batch, reqs: list[tuple[int, int]]):
    from aserve.layers.attention import AttentionMetadata

    return AttentionMetadata(b.starts, b.seq_lens, b.table, b.slots, max(q for q, _ in reqs),
                             max(s for _, s in reqs), b.starts.tolist(), b.seq_lens.tolist())


def run_cpu_op(op: str, b: Batch, reqs: list[tuple[int, int]], scale: float,
               window: int | None, soft_cap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`cpu_kernel_ops(dtype)`'s attention_forward (store + attend; this step's rows zeroed in
    the cache first) or paged_attention (over the filled cache) on the batch."""
    from aserve.backends.cpu_ops import cpu_kernel_ops

    ops = cpu_kernel_ops(b.q.dtype)
    if op == "paged_attention":
        return ops.paged_attention(b.q, b.k_cache, b.v_cache, b.starts, b.seq_lens, b.table,
                                   scale, window, soft_cap,
                                   query_start_loc_cpu=b.starts.tolist(),
                                   seq_lens_cpu=b.seq_lens.tolist(), key=b.key, value=b.value,
                                   sinks=sinks)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[b.slots] = 0
    v_cache.view(-1, num_kv_heads, head_dim)[b.slots] = 0
    out = ops.attention_forward(b.q, b.key, b.value, k_cache, v_cache, metadata(b, reqs),
                                scale, window, soft_cap, sinks=sinks)
    for cache, want in ((k_cache, b.k_cache), (v_cache, b.v_cache)):  # stored; NaN poison too
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    return out


def triton_attention():
    """`paged_attention_triton` on a Batch (on the GPU, else the interpreter), or a skip."""
    pytest.importorskip("triton")
    from aserve.kernels.paged_attention_triton import _attention_kernel, paged_attention_triton
    from aserve.kernels.triton_utils import is_interpreted

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not is_interpreted(_attention_kernel):
        pytest.skip("no GPU, and the kernels were decorated before TRITON_INTERPRET=1 was set")

    def run(b: Batch, scale: float, window: int | None, soft_cap: float | None,
            num_splits: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        args = [x.to(device) for x in (b.q, b.k_cache, b.v_cache, b.starts, b.seq_lens,
                                       b.table)]
        return paged_attention_triton(*args, scale, window, soft_cap, num_splits=num_splits,
                                      seq_lens_cpu=b.seq_lens.tolist(),
                                      sinks=None if sinks is None else sinks.to(device)).cpu()

    return run
