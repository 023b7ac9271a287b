"""`DraftModel`: speculative decoding's `draft_model` method, the runner's side. A smaller
model with the target's vocabulary proposes drafts greedily after each step:

    step N   target forward on the step's tokens ─┐ the draft model on the same tokens, into
             verify, sample t (the token after     ┘ its own KV (rows of rejected drafts are
             the accepted drafts)                    written again later, as the target's),
                                                     while drafting pays (it rests while the
                                                     cost policy stops drafting)
             draft: t at p -> d1, d1 at p+1 -> d2, ... (k decode passes of the draft model
             over every request that sampled, batched); d1..dk go back with the step's output
    step N+1 the target verifies t, d1..dk (`spec_verify.py`: drafts as one-hot, exact)

The draft model's KV buffers are indexed by the target's block ids: its layers are bound to
the target's full-attention KV cache group, whose block tables it reads, so the scheduler's
blocks serve both models, prefix hits and preemption included. The scheduler allocates k
slots past each step's tokens for the passes above (`Scheduler`'s lookahead). Greedy drafts
are one-hot, as vLLM's draft and EAGLE proposers treat theirs, so verification stays exact
for random sampling too.

Under tensor, pipeline or sequence parallelism the draft model lives on rank 0 alone, whole
(`distributed.single_rank`: built and run as if it were the only rank), beside the target's
first stage and shard: rank 0 samples, and the drafts reach the other ranks as the next step's
inputs do. Its KV buffers, whole, are counted in rank 0's block size (rank 0 sizes the cache).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from aserve.backends import Platform
from aserve.config import KVCacheGroupSpec, ModelConfig
from aserve.distributed import single_rank
from aserve.layers import bind_ops
from aserve.layers.attention import AttentionMetadata
from aserve.models import load_model
from aserve.models.arch_config import ModelArchConfig
from aserve.runner.kv_cache import allocate_kv_buffers, kv_cache_bytes_per_block


class PagedDrafter:
    """What a draft model and an EAGLE head (`spec_eagle.py`) share: KV buffers of the
    target's block count bound to its full-attention group, the metadata of a decode pass (one
    token a request), and where a request's blocks stop."""

    model: torch.nn.Module  # with attention_layers()
    arch: ModelArchConfig  # its KV shape and dtype

    def __init__(self, device: torch.device, num_tokens: int) -> None:
        self.device = device
        self.k = num_tokens
        self.group, self.block_size = 0, 1
        self.buffers: list[torch.Tensor] = []

    @property
    def num_kv_heads(self) -> int:
        return self.model.attention_layers()[0].num_kv_heads

    def bytes_per_block(self, block_size: int) -> int:
        return kv_cache_bytes_per_block(self.arch, block_size, len(self.model.attention_layers()),
                                        self.num_kv_heads)

    def initialize_kv_cache(self, num_blocks: int, block_size: int,
                            kv_cache_groups: list[KVCacheGroupSpec]) -> None:
        """Buffers of the target's block count, bound to its full-attention group."""
        full = [g for g, group in enumerate(kv_cache_groups) if group.sliding_window is None]
        if not full:
            raise ValueError("a draft model needs a target with full-attention layers (its "
                             "block tables cover every position).")
        self.group, self.block_size = full[0], block_size
        layers = self.model.attention_layers()
        buffers = allocate_kv_buffers(self.arch, num_blocks, block_size, range(len(layers)),
                                      self.num_kv_heads, self.device)
        self.buffers = list(buffers.values())
        for i, layer in enumerate(layers):
            layer.bind_kv_cache(buffers[i], self.group)

    def covered(self, table: np.ndarray, row: int, position: int) -> bool:
        """Whether row `row` of `table` (the full group's) has a block at `position`."""
        block = position // self.block_size
        return block < table.shape[1] and table[row, block] != 0

    def metadata(self, rows: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                 slots: np.ndarray, num_groups: int) -> AttentionMetadata:
        """Attention metadata of a pass: `rows` the requests' block-table rows (the full
        group's), each with `query_lens` tokens ending its sequence of `seq_lens`."""
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        seq_lens = seq_lens.astype(np.int32)
        metadata = AttentionMetadata(
            query_start_loc=self._tensor(starts), seq_lens=self._tensor(seq_lens),
            block_table=self._tensor(np.ascontiguousarray(rows)),
            slot_mapping=self._tensor(slots.astype(np.int64)),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=starts.tolist(), seq_lens_cpu=seq_lens.tolist())
        if num_groups > 1:  # (its layers read their own group's; the others are unused)
            metadata = replace(metadata, group_metadata=(metadata,) * num_groups)
        return metadata

    def decode_metadata(self, rows: np.ndarray, pos: np.ndarray, num_groups: int
                        ) -> AttentionMetadata:
        """One token a request, at `pos`."""
        slots = rows[np.arange(len(pos)), pos // self.block_size].astype(np.int64)
        slots = slots * self.block_size + pos % self.block_size
        return self.metadata(rows, np.ones(len(pos), dtype=np.int32), pos + 1, slots,
                             num_groups)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)


class DraftModel(PagedDrafter):
    def __init__(self, model_config: ModelConfig, platform: Platform, device: torch.device,
                 vocab_size: int, num_tokens: int) -> None:
        super().__init__(device, num_tokens)
        with single_rank():  # whole on rank 0, whatever the target's layout
            self.model, self.arch = load_model(model_config, device,
                                               platform.quantized_float16_as)
        self.model.eval()
        self.ops = platform.kernel_ops(self.arch.dtype)
        bind_ops(self.model, self.ops)
        if self.arch.vocab_size != vocab_size:
            raise ValueError(f"the draft model {model_config.model} has a vocabulary of "
                             f"{self.arch.vocab_size} tokens, the target {vocab_size}: a draft "
                             "model needs the target's tokenizer.")
        if any(w is not None for w in self.arch.layer_windows):
            raise ValueError(f"the draft model {model_config.model} has sliding-window layers; "
                             "a draft model of full-attention layers only is supported.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> None:
        """The draft model over a step's tokens (the target's inputs): its K/V, nothing else."""
        with single_rank():
            self.model(input_ids, positions, metadata)

    def propose(self, tokens: list[int], positions: list[int], tables: list[np.ndarray],
                num_groups: int, counts: list[int]) -> tuple[list[list[int]], int]:
        """`counts[i]` (at most k) greedy drafts for each request whose last token
        `tokens[i]` sits at `positions[i]`; `tables`: the requests' block tables per group
        (rows in order). A request stops drafting at a position its blocks do not cover.
        Returns the drafts and the passes run."""
        with single_rank():
            return self._propose(tokens, positions, tables[self.group], num_groups, counts)

    def _propose(self, tokens: list[int], positions: list[int], table: np.ndarray,
                 num_groups: int, counts: list[int]) -> tuple[list[list[int]], int]:
        drafts: list[list[int]] = [[] for _ in tokens]
        active = list(range(len(tokens)))
        current, where = list(tokens), list(positions)
        passes = 0
        for step in range(min(self.k, max(counts, default=0))):
            active = [i for i in active
                      if counts[i] > step and self.covered(table, i, where[i])]
            if not active:
                break
            passes += 1
            pos = np.array([where[i] for i in active], dtype=np.int64)
            metadata = self.decode_metadata(table[active], pos, num_groups)
            ids = self._tensor(np.array([current[i] for i in active], dtype=np.int64))
            hidden = self.model(ids, self._tensor(pos), metadata)
            chosen = self.ops.argmax(self.model.compute_logits(hidden).float()).tolist()
            for i, token in zip(active, chosen, strict=True):
                drafts[i].append(int(token))
                current[i], where[i] = int(token), where[i] + 1
        return drafts, passes
