"""Decode-only steps replayed as captured graphs (CUDA graphs; HIP graphs on ROCm).

At start-up the forward of a decode batch is captured once per size in `capture_sizes`, reading
static input buffers. A decode-only step of n requests copies its inputs into the first n rows,
pads the batch up to the next captured size and replays that graph:

    captured size 8, n = 5       rows 0..4: the step's requests     rows 5..7: padding
    input_ids / positions        the step's tokens                  0
    slot_mapping                 the step's slots                   -1 (K/V not written)
    seq_lens / block_table       the step's                         1 / block 0 (read, ignored)

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
                 num_kv_groups: int = 1) -> None:
        self.model, self.platform = model, platform
        self.sizes = sorted(capture_sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mappings = [torch.full((n,), -1, dtype=torch.int64, device=device)
                              for _ in range(num_kv_groups)]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
                             for _ in range(num_kv_groups)]
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.num_replays = 0

    def _metadata(self, size: int) -> AttentionMetadata:
        groups = [AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=table[:size], slot_mapping=slots[:size],
            max_query_len=1, max_seq_len=self.max_blocks_per_seq)
            for table, slots in zip(self.block_tables, self.slot_mappings, strict=True)]
        if len(groups) == 1:
            return groups[0]
        return replace(groups[0], group_metadata=tuple(groups))

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the pool grows once, smaller ones reuse it)."""
        pool = self.platform.graph_pool()
        for size in reversed(self.sizes):
            for _ in range(2):  # warm up: kernels compiled, allocator settled
                self._forward(size)
            self.platform.synchronize()
            self.graphs[size] = self.platform.capture_graph(lambda s=size: self._forward(s), pool)
        self.platform.synchronize()

    def can_run(self, inputs: PreparedInputs) -> bool:
        """A decode-only step within the largest captured size and block-table width."""
        num_reqs = len(inputs.seq_lens)
        return (len(inputs.input_ids) == num_reqs <= self.sizes[-1]
                and all(t.shape[1] <= self.max_blocks_per_seq for t in inputs.block_tables))

    def run(self, inputs: PreparedInputs) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= the batch; [n, hidden]."""
        n = len(inputs.seq_lens)
        size = next(s for s in self.sizes if s >= n)
        self._load(self.input_ids, inputs.input_ids, size, 0)
        self._load(self.positions, inputs.positions, size, 0)
        self._load(self.seq_lens, inputs.seq_lens, size, 1)
        for slots, values in zip(self.slot_mappings, inputs.slot_mappings, strict=True):
            self._load(slots, values, size, -1)
        for table, values in zip(self.block_tables, inputs.block_tables, strict=True):
            table[:size].zero_()
            table[:n, :values.shape[1]].copy_(torch.from_numpy(values), non_blocking=True)
        replay, out = self.graphs[size]
        replay()
        self.num_replays += 1
        return out[:n]

    @staticmethod
    def _load(buffer: torch.Tensor, values: np.ndarray, size: int, pad: int) -> None:
        n = len(values)
        buffer[:n].copy_(torch.from_numpy(values), non_blocking=True)
        buffer[n:size].fill_(pad)
