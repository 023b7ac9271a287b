"""Causal attention of a ragged batch over the paged KV cache (torch reference twin).

Cache layout (one layer): `kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`,
`k_cache = kv_cache[0]`, `v_cache = kv_cache[1]`. Request r's token i lives in block
`block_table[r, i // block_size]` at offset `i % block_size` (slot `block_id * block_size + off`):

```
block_table[r] = [7, 2, 5, ...]        block_size = 4, seq_lens[r] = 10
  token:   0  1  2  3 |  4  5  6  7 |  8  9
  block:   7  7  7  7 |  2  2  2  2 |  5  5  .  .      (entries past the need are ignored)
```

The batch is ragged: request r owns query rows `query_start_loc[r]:query_start_loc[r+1]`, which
are the LAST q_len tokens of its sequence (positions `seq_len - q_len .. seq_len - 1`):

```
q rows:   | r0: prefill chunk (5) | r1: decode (1) | r2: decode (1) | r3: chunk (3) |
          0                       5                6                7               10
```

Query at position p sees keys j with `j <= p` and, with a sliding window w, `p - j < w` (HF's
convention). An optional soft cap squashes scores to `cap * tanh(s / cap)` before the softmax.
Optional attention sinks (gpt-oss) give query head h one more logit `sinks[h]`, unscaled, that
joins every row's softmax but carries no value: with m the max over the row's visible scores
and the sink,

    p_j = exp(s_j - m) / (exp(sinks[h] - m) + sum_i exp(s_i - m))      (the p_j sum to < 1)

whatever the window (the sink is never masked). All decode rows (q_len == 1) go through ONE
batched call over K/V gathered into a padded `[B, max_len, Hkv, D]` with a length mask; each
longer chunk is one SDPA call. Math happens in the query's dtype (as HF's sdpa does), except
soft-capped scores and scores with sinks, which are an explicit float32 softmax (the cap's tanh
needs more than bf16's 8 bits near the cap; SDPA takes no sinks), in the order of HF's eager
attention. This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[NB, BS, Hkv, D] cache, [B, nblk] block ids -> [B, Hkv, length, D] contiguous keys."""
    num_blocks = cache.shape[0]
    blocks = cache[block_ids.long().clamp(0, num_blocks - 1)]  # [B, nblk, BS, Hkv, D]
    rows = blocks.flatten(1, 2)[:, :length]  # [B, length, Hkv, D]
    return rows.transpose(1, 2)  # [B, Hkv, length, D]


def _key_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor,
              sliding_window: int | None) -> torch.Tensor:
    """Boolean mask, True where a query may attend: broadcast of q_pos [..., Lq, 1] and
    k_pos [1, Lk] against seq_len [..., 1, 1]."""
    allowed = (k_pos <= q_pos) & (k_pos < seq_len)
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def checked_sinks(name: str, sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """`sinks` as every kernel takes them: float32 [Hq], contiguous, on q's device (q [T, Hq, D]);
    None stays None."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{name}: sinks must be [{q.shape[1]}] (one per query head), got "
                         f"{tuple(sinks.shape)}.")
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


def _softmax(scores: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None
             ) -> torch.Tensor:
    """Float32 probabilities of scores [..., Lk] over the keys `mask` allows. With `sinks`
    (broadcast against scores[..., :1]) each row also has that logit in its softmax, as HF's
    gpt-oss eager attention has it: appended after the mask, the row's max (sink included)
    subtracted, the softmax taken, the sink's column dropped."""
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    logits = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)  # [..., Lk + 1]
    logits = logits - logits.amax(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, soft_cap: float | None, sinks: torch.Tensor | None = None
            ) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D], mask [B|1, 1, Lq, Lk] (None: causal from 0),
    sinks float32 [Hq] or None."""
    if soft_cap is None and sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    # capped scores, and scores with sinks, in float32 as in `_attend_decode` (float32 inputs
    # run exactly as before): bf16 rounds a score near a cap of 50 to a multiple of 0.25 before
    # the softmax, and SDPA takes no sinks
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [B, Hq, Lk, D]
    v = v.float().repeat_interleave(group, dim=1)  # [B, Hq, Lk, D]
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale  # [B, Hq, Lq, Lk]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    probs = _softmax(scores, mask, None if sinks is None else sinks.view(1, -1, 1, 1))
    return torch.matmul(probs, v).to(q.dtype)  # [B, Hq, Lq, D]


def _attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float, soft_cap: float | None, sinks: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """One query row per request: q [B, Hq, 1, D], k/v [B, Hkv, Lk, D], mask [B, 1, 1, Lk].

    Query heads are grouped onto their kv head ([B, Hkv, G, D]) so GQA needs no copies; the math
    runs in float32. On CPU this is faster than SDPA for one query row in bfloat16 and at least
    as accurate (docs/benchmarks/throughput.md, "Offline throughput — engine core"); float32
    inputs without a cap or sinks keep SDPA, so that they stay bit-equal to transformers.
    """
    if q.dtype == torch.float32 and soft_cap is None and sinks is None:
        return _attend(q, k, v, mask, scale, soft_cap)
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    q_grouped = q.view(b, hkv, hq // hkv, d).float()  # [B, Hkv, G, D]
    scores = torch.matmul(q_grouped, k.float().transpose(-1, -2)) * scale  # [B, Hkv, G, Lk]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    group_sinks = None if sinks is None else sinks.view(1, hkv, hq // hkv, 1)
    probs = _softmax(scores, mask, group_sinks)  # [B, Hkv, G, Lk]
    return torch.matmul(probs, v.float()).view(b, hq, 1, d).to(q.dtype)  # [B, Hq, 1, D]


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, rows: list[int], reqs: list[int], lens: list[int],
                  scale: float, sliding_window: int | None, soft_cap: float | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """All q_len == 1 requests at once. rows: their q rows, reqs: request ids, lens: seq lens."""
    device, block_size = q.device, k_cache.shape[1]
    max_len = max(lens)
    num_cols = -(-max_len // block_size)
    req_idx = torch.tensor(reqs, device=block_table.device)
    block_ids = block_table[req_idx, :num_cols].to(device)  # [B, nblk]
    k = _gather_kv(k_cache, block_ids, max_len).to(q.dtype)  # [B, Hkv, max_len, D]
    v = _gather_kv(v_cache, block_ids, max_len).to(q.dtype)  # [B, Hkv, max_len, D]
    seq_len = torch.tensor(lens, device=device).view(-1, 1, 1, 1)  # [B, 1, 1, 1]
    k_pos = torch.arange(max_len, device=device)  # [max_len]
    mask = _key_mask(seq_len - 1, k_pos, seq_len, sliding_window)  # [B, 1, 1, max_len]
    q_rows = q[torch.tensor(rows, device=device)].unsqueeze(2)  # [B, Hq, 1, D]
    return _attend_decode(q_rows, k, v, mask, scale, soft_cap, sinks).squeeze(2)  # [B, Hq, D]


def _chunk(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_ids: torch.Tensor, seq_len: int, scale: float, sliding_window: int | None,
           soft_cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request's chunk: q_rows [q_len, Hq, D] are the last q_len of seq_len tokens."""
    device, q_len = q_rows.device, q_rows.shape[0]
    k = _gather_kv(k_cache, block_ids[None], seq_len).to(q_rows.dtype)  # [1, Hkv, seq_len, D]
    v = _gather_kv(v_cache, block_ids[None], seq_len).to(q_rows.dtype)  # [1, Hkv, seq_len, D]
    mask = None
    if q_len != seq_len or sliding_window is not None:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device).view(q_len, 1)
        k_pos = torch.arange(seq_len, device=device)  # [seq_len]
        mask = _key_mask(q_pos, k_pos, torch.tensor(seq_len, device=device), sliding_window)
    q_b = q_rows.transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    return _attend(q_b, k, v, mask, scale, soft_cap, sinks)[0].transpose(0, 1)  # [q_len, Hq, D]


def _fresh_chunk(q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                 scale: float, sliding_window: int | None, soft_cap: float | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk that is its request's whole sequence: causal attention over its own rows."""
    q_b, k_b, v_b = (x.transpose(0, 1).unsqueeze(0) for x in (q_rows, k_rows, v_rows))
    mask = None
    if sliding_window is not None:
        pos = torch.arange(q_rows.shape[0], device=q_rows.device)
        mask = _key_mask(pos.view(-1, 1), pos, torch.tensor(len(pos), device=pos.device),
                         sliding_window)
    return _attend(q_b, k_b.to(q_rows.dtype), v_b.to(q_rows.dtype), mask, scale, soft_cap,
                   sinks)[0].transpose(0, 1)  # [q_len, Hq, D]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        out: torch.Tensor | None = None, *,
                        query_start_loc_cpu: list[int] | None = None,
                        seq_lens_cpu: list[int] | None = None,
                        key: torch.Tensor | None = None,
                        value: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged caches [NB, BS, Hkv, D]; returns [T, Hq, D].

    query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, M] int32 (entries past a
    request's need are ignored). `query_start_loc_cpu` / `seq_lens_cpu` are optional host copies
    of the first two (python lists) that spare the device -> host copy. `key` / `value`
    [T, Hkv, D] are optionally this step's own K/V rows (aligned with q, already stored): a chunk
    with no cached context (q_len == seq_len) then attends over them directly instead of reading
    the cache back. `sinks` [Hq] (float32; None: no sinks) are gpt-oss's per-head sink logits
    (see the module docstring). Rows of `out` past `query_start_loc[R]` (padding) are left
    untouched (zeros when `out` is None).
    """
    sinks = checked_sinks("paged_attention_ref", sinks, q)
    starts, lens, decodes, out = batch_layout(q, k_cache, query_start_loc, seq_lens, out,
                                              query_start_loc_cpu, seq_lens_cpu)
    if decodes:
        rows = [starts[r] for r in decodes]
        out[rows] = _decode_batch(q, k_cache, v_cache, block_table, rows, decodes,
                                  [lens[r] for r in decodes], scale, sliding_window, soft_cap,
                                  sinks)
    attend_chunks(q, k_cache, v_cache, starts, lens, block_table, scale, sliding_window,
                  soft_cap, out, key, value, sinks=sinks)
    return out


def batch_layout(q: torch.Tensor, k_cache: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor | None,
                 query_start_loc_cpu: list[int] | None, seq_lens_cpu: list[int] | None
                 ) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """Host lists of query starts and sequence lengths, the decode requests (one query row),
    and the output buffer; checks that the query heads group onto the kv heads."""
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of "
                         f"{k_cache.shape[2]} kv heads.")
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    decodes = [r for r in range(len(lens)) if starts[r + 1] - starts[r] == 1]
    return starts, lens, decodes, torch.zeros_like(q) if out is None else out


def attend_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: list[int], lens: list[int], block_table: torch.Tensor, scale: float,
                  sliding_window: int | None, soft_cap: float | None, out: torch.Tensor,
                  key: torch.Tensor | None, value: torch.Tensor | None,
                  reqs: list[int] | None = None, sinks: torch.Tensor | None = None) -> None:
    """The rows of requests with more than one query token (prefill chunks), into `out`; only
    those of `reqs` when given. `sinks`: float32 [Hq] on q's device (`checked_sinks`), or
    None."""
    block_size = k_cache.shape[1]
    for r in range(len(lens)) if reqs is None else reqs:
        seq_len, start, end = lens[r], starts[r], starts[r + 1]
        if end - start <= 1:
            continue
        if key is not None and end - start == seq_len:  # a whole prompt: no cached context
            out[start:end] = _fresh_chunk(q[start:end], key[start:end], value[start:end], scale,
                                          sliding_window, soft_cap, sinks)
            continue
        block_ids = block_table[r, : -(-seq_len // block_size)].to(q.device)  # [nblk]
        out[start:end] = _chunk(q[start:end], k_cache, v_cache, block_ids, seq_len, scale,
                                sliding_window, soft_cap, sinks)
