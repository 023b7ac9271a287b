"""Attention on CPU for every row of a batch, bf16 + AVX-512, in C++ (`csrc/attention_rows.h`,
in the extension of `cpu_extension.load`), reading K/V straight from the paged cache: no gathered
copy of any sequence.

    cpu_attention_forward   the layer's entry (KernelOps.attention_forward): store this step's K/V,
                            then attend for every row of the batch, two C++ calls per layer
    attend_rows (C++)       tiles of up to ROW_TILE query rows of one request (a decode row is a
                            tile of one; a prefill chunk, with or without cached context, is cut
                            into tiles); on AMX machines chunks of SDPA_MIN_ROWS rows and
                            SDPA_MIN_WORK rows x keys or more go to SDPA instead
    store_kv (C++)          this step's K/V rows into their slots

One task per (tile, kv head) serves the tile's rows x G = Hq / Hkv query heads at once, so each
K/V row is read once per task; row j of a tile attends the first len0 + j keys of its sequence:

    block_table[r] = [7, 2, 5]   seq_len = 10, block_size = 4
    keys t = 0..9 at  k_cache[7][0..3], k_cache[2][0..3], k_cache[5][0..1]   (head h of each)
    a chunk of 3 rows ending at key 9: rows attend keys 0..7, 0..8, 0..9

The per-task work (keys transposed into lanes so that each query's scores for 16 keys are one
dpbf16 chain, a float32 softmax over each query's own keys into bf16 probabilities, the weighted
sum of values on pairs of keys, its sums in registers) is the register tiles of
`csrc/attention_tiles.h`. Threads claim tasks one at a time, costliest first (`plan_tiles`
orders them). `benchmarks/studies/attention.py` times it (docs/benchmarks/throughput.md,
"Seventh and eighth runs").
On AVX2 hosts (no AVX-512) the same tiles run 8 lanes wide in float32 (`attend_tiles_avx2`:
a decode row's task takes every kv head where the tiles alone keep the threads busy, a chunk's
tiles and few tiles one kv head a task; scores 8 keys at a time, one FMA chain a key and head,
each K vector made float once for up to 3 heads of its group, the 8 summed across lanes at
once; the weighted values two heads and 32 dims at a time in registers, 64 keys for every
head before the next 64; K fetched 16 keys ahead and V a chunk ahead, exp8, float32
probabilities, one bf16 rounding of each output), so the whole-layer call runs there too.
Where neither applies (fp16, head_dim % 16, no AVX2), `cpu_attention_forward` is
`store_kv_ref` + `paged_attention_cpu`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from aserve.kernels import cpu_extension
from aserve.kernels.paged_attention import attend_chunks, checked_sinks
from aserve.kernels.paged_attention_cpu import paged_attention_cpu

ROW_TILE = 8  # query rows of one request that share a task (and each K/V row read)
# Where torch's SDPA runs on AMX tiles (oneDNN's GEMMs), a chunk of at least SDPA_MIN_ROWS rows
# and SDPA_MIN_WORK rows x keys goes to it: there it beats the row tiles from about that size on,
# and the row tiles win below it. Without AMX the row-tile kernel is the faster one at every
# size, so it takes every chunk. docs/benchmarks/serving-latency.md, "Long-context prefill" and
# "On a Xeon with AMX".
SDPA_MIN_ROWS = 32
SDPA_MIN_WORK = 32 * 1024
# On AVX2-only hosts the row tasks are float32 (`attend_tiles_avx2`), and SDPA takes
# long chunks as on AMX: a 1,024-token smol prompt's first token 5.8 s -> 3.4 s (Zen 3).
SDPA_FOR_LONG_CHUNKS = (bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
                        or torch.backends.cpu.get_cpu_capability() == "AVX2")


def goes_to_sdpa(q_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Which chunks (rows, keys of the last row) SDPA takes where `SDPA_FOR_LONG_CHUNKS`."""
    return (q_lens >= SDPA_MIN_ROWS) & (q_lens * seq_lens >= SDPA_MIN_WORK)


def plan_tiles(starts: np.ndarray, seq_lens: np.ndarray, row_tile: int = ROW_TILE,
               long_chunk: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Row tiles of one step for `attend_rows`: [N, 4] int64 (request, first row, rows, keys of
    the first row), the costliest first (rows x keys: threads claim them in this order, so the
    big ones do not come last), and the requests whose chunk is left to SDPA (`goes_to_sdpa`
    where `SDPA_FOR_LONG_CHUNKS`, else none; `long_chunk`: those of more rows than that)."""
    q_lens = np.diff(starts).astype(np.int64)
    if long_chunk is not None:
        to_sdpa = q_lens > long_chunk
    elif SDPA_FOR_LONG_CHUNKS:
        to_sdpa = goes_to_sdpa(q_lens, np.asarray(seq_lens, dtype=np.int64))
    else:
        to_sdpa = np.zeros(len(q_lens), dtype=bool)
    long_reqs = np.flatnonzero(to_sdpa)
    tiled = np.where(to_sdpa, 0, q_lens)
    num_tiles = -(-tiled // row_tile)
    req = np.repeat(np.arange(len(q_lens)), num_tiles)
    k = np.arange(len(req)) - np.repeat(np.cumsum(num_tiles) - num_tiles, num_tiles)
    tiles = np.stack([req, starts[:-1][req] + k * row_tile,
                      np.minimum(row_tile, q_lens[req] - k * row_tile),
                      seq_lens[req] - q_lens[req] + 1 + k * row_tile], axis=1)
    tiles = tiles[np.argsort(-tiles[:, 2] * (tiles[:, 3] + tiles[:, 2]), kind="stable")]
    return torch.from_numpy(tiles.astype(np.int64)), long_reqs.tolist()


class RowPlan(NamedTuple):
    """What every layer of a step shares: the row tiles, the long chunks, host copies of the
    batch layout, and the kernel's dtypes of block table and slots."""

    tiles: torch.Tensor  # [N, 4] int64, see plan_tiles
    long_reqs: list[int]
    starts: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # int32, contiguous
    slot_mapping: torch.Tensor  # int64, contiguous

    @classmethod
    def of(cls, m) -> RowPlan:
        """The plan of a step's `AttentionMetadata`: made on the first layer's call, then kept
        on `m.kernel_plan` for every other layer (and `cpu_block`'s calls)."""
        if m.kernel_plan is not None:
            return m.kernel_plan
        starts = np.asarray(m.query_start_loc_cpu if m.query_start_loc_cpu is not None
                            else m.query_start_loc.tolist(), dtype=np.int64)
        lens = np.asarray(m.seq_lens_cpu if m.seq_lens_cpu is not None
                          else m.seq_lens.tolist(), dtype=np.int64)
        tiles, long_reqs = plan_tiles(starts, lens)
        m.kernel_plan = cls(tiles, long_reqs, starts.tolist(), lens.tolist(),
                            m.block_table.to(torch.int32).contiguous(),
                            m.slot_mapping.to(torch.int64).contiguous())
        return m.kernel_plan


def cpu_attention_forward(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, metadata,
                          scale: float, sliding_window: int | None = None,
                          soft_cap: float | None = None, *,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Store this step's K/V and attend, for every row of the batch, in two C++ calls.

    q [T, Hq, D], key/value [T, Hkv, D] (rows may be strided), caches [NB, BS, Hkv, D];
    `metadata` is the step's `AttentionMetadata`: the row tiles are planned on the first layer's
    call and kept on it (`metadata.kernel_plan`) for the others. `sinks` [Hq] float32 or None,
    as in `paged_attention_ref`. Where the row-tile kernel does not apply (no AVX-512 build,
    fp16, head_dim % 16) this is `store_kv_ref` + `paged_attention_cpu`.
    """
    m = metadata
    module = cpu_extension.load()
    if module is None or not module.rows_supported(q):
        from aserve.kernels.store_kv import store_kv_ref

        store_kv_ref(key, value, k_cache, v_cache, m.slot_mapping)
        return paged_attention_cpu(
            q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_table, scale,
            sliding_window, soft_cap, query_start_loc_cpu=m.query_start_loc_cpu,
            seq_lens_cpu=m.seq_lens_cpu, key=key, value=value, sinks=sinks)
    sinks = checked_sinks("cpu_attention_forward", sinks, q)
    plan = RowPlan.of(m)
    starts, lens, block_table = plan.starts, plan.seq_lens, plan.block_table
    module.store_kv(key, value, k_cache, v_cache, plan.slot_mapping)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()  # rows may be strided (q of the qkv output), heads not
    out = q.new_empty(q.shape)
    if starts[-1] < q.shape[0]:  # padding rows past the last request: defined, never read
        out[starts[-1]:] = 0
    if len(plan.tiles):
        module.attend_rows(q, k_cache, v_cache, block_table, plan.tiles, out, scale,
                           sliding_window or 0, soft_cap or 0.0, sinks)
    if plan.long_reqs:
        attend_chunks(q, k_cache, v_cache, starts, lens, block_table, scale, sliding_window,
                      soft_cap, out, key, value, reqs=plan.long_reqs, sinks=sinks)
    return out
