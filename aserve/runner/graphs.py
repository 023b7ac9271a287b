"""Decode steps and verification steps replayed as captured graphs (CUDA graphs; HIP graphs on
ROCm).

At start-up the forward of a decode batch is captured once per size in `capture_sizes`, reading
static input buffers. A decode-only step of n requests copies its inputs into the first n rows,
pads the batch up to the next captured size and replays that graph:

    captured size 8, n = 5       rows 0..4: the step's requests     rows 5..7: padding
    input_ids / positions        the step's tokens                  0
    slot_mapping                 the step's slots                   -1 (K/V not written)
    seq_lens / block_table       the step's                         1 / block 0 (read, ignored)

With speculative decoding (k drafts), steps where every request verifies k drafts (1 + k rows
each: the uniform query vLLM captures too) have graphs of their own, for the sizes whose
tokens stay within the largest decode size's: the same buffers, q = 1 + k rows a request,
padding requests of q rows with a sequence of q. Other mixes (fewer drafts for some
requests, prefill chunks) run eagerly.

Each KV cache group has its own block table and slot mapping buffers (hybrid KV cache).

The attention metadata of a graph carries no host lists, so the kernels size their launch from
tensor shapes alone (fixed at capture). Prefill or mixed steps, and batches larger than the
largest size, run eagerly. The platform does the capture (its `capture_graph`), so this
module never names a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from aserve.backends import Platform
from aserve.layers.attention import AttentionMetadata
from aserve.runner.input_batch import PreparedInputs


def default_capture_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, largest)."""
    top = min(max_num_seqs, largest)
    return sorted({s for s in [1, 2, 4, *range(8, top + 1, 8)] if s <= top} | {top})


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, platform: Platform, device: torch.device,
                 capture_sizes: list[int], max_blocks_per_seq: int,
                 num_kv_groups: int = 1, num_speculative_tokens: int = 0) -> None:
        self.model, self.platform = model, platform
        self.sizes = sorted(capture_sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        n = self.sizes[-1]
        # rows a request -> the request counts captured with that many
        self.captured_sizes = {1: self.sizes}
        if num_speculative_tokens > 0:
            q = 1 + num_speculative_tokens
            self.captured_sizes[q] = [s for s in self.sizes if s * q <= n] or [1]
        tokens = max(q * sizes[-1] for q, sizes in self.captured_sizes.items())
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mappings = [torch.full((tokens,), -1, dtype=torch.int64, device=device)
                              for _ in range(num_kv_groups)]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_locs = {q: torch.arange(0, q * (n + 1), q, dtype=torch.int32,
                                                 device=device)
                                 for q in self.captured_sizes}
        self.block_tables = [torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
                             for _ in range(num_kv_groups)]
        # (requests, rows a request) -> (replay, output)
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = dict.fromkeys(self.captured_sizes, 0)  # per rows a request

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def _metadata(self, size: int, q: int) -> AttentionMetadata:
        groups = [AttentionMetadata(
            query_start_loc=self.query_start_locs[q][:size + 1], seq_lens=self.seq_lens[:size],
            block_table=table[:size], slot_mapping=slots[:size * q],
            max_query_len=q, max_seq_len=self.max_blocks_per_seq)
            for table, slots in zip(self.block_tables, self.slot_mappings, strict=True)]
        if len(groups) == 1:
            return groups[0]
        return replace(groups[0], group_metadata=tuple(groups))

    def _forward(self, size: int, q: int) -> torch.Tensor:
        rows = size * q
        return self.model(self.input_ids[:rows], self.positions[:rows],
                          self._metadata(size, q))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the pool grows once, smaller ones reuse it)."""
        pool = self.platform.graph_pool()
        shapes = sorted(((size, q) for q, sizes in self.captured_sizes.items() for size in sizes),
                        key=lambda shape: -shape[0] * shape[1])
        for size, q in shapes:
            self.seq_lens[:size].fill_(q)  # (warm-up rows: q query rows in a sequence of q)
            for _ in range(2):  # warm up: kernels compiled, allocator settled
                self._forward(size, q)
            self.platform.synchronize()
            self.graphs[size, q] = self.platform.capture_graph(
                lambda s=size, r=q: self._forward(s, r), pool)
        self.platform.synchronize()

    def _rows_a_request(self, inputs: PreparedInputs) -> int | None:
        """q when every request of the step has q rows and q was captured, else None."""
        num_reqs, num_tokens = len(inputs.seq_lens), len(inputs.input_ids)
        if num_reqs == 0 or num_tokens % num_reqs:
            return None
        q = num_tokens // num_reqs
        if q not in self.captured_sizes or (
                q > 1 and np.any(np.diff(inputs.query_start_loc[:num_reqs + 1]) != q)):
            return None
        return q

    def can_run(self, inputs: PreparedInputs) -> bool:
        """A decode-only step, or one where every request verifies k drafts, within the
        largest captured size and block-table width."""
        q = self._rows_a_request(inputs)
        return (q is not None and len(inputs.seq_lens) <= self.captured_sizes[q][-1]
                and all(t.shape[1] <= self.max_blocks_per_seq for t in inputs.block_tables))

    def run(self, inputs: PreparedInputs) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= the batch; [n q, hidden]."""
        n, q = len(inputs.seq_lens), self._rows_a_request(inputs)
        size = next(s for s in self.captured_sizes[q] if s >= n)
        self._load(self.input_ids, inputs.input_ids, size * q, 0)
        self._load(self.positions, inputs.positions, size * q, 0)
        self._load(self.seq_lens, inputs.seq_lens, size, q)
        for slots, values in zip(self.slot_mappings, inputs.slot_mappings, strict=True):
            self._load(slots, values, size * q, -1)
        for table, values in zip(self.block_tables, inputs.block_tables, strict=True):
            table[:size].zero_()
            table[:n, :values.shape[1]].copy_(torch.from_numpy(values), non_blocking=True)
        replay, out = self.graphs[size, q]
        replay()
        self.replays[q] += 1
        return out[:n * q]

    @staticmethod
    def _load(buffer: torch.Tensor, values: np.ndarray, size: int, pad: int) -> None:
        n = len(values)
        buffer[:n].copy_(torch.from_numpy(values), non_blocking=True)
        buffer[n:size].fill_(pad)
