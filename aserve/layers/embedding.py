"""Token embedding and LM head, split over tensor-parallel ranks by vocabulary rows.

```
vocab rows:  [ rank 0: 0 .. V/tp-1 | rank 1: V/tp .. 2V/tp-1 | ... ]   (last part zero-padded)
embedding:   each rank looks up the ids it owns, zeroes the rest, all-reduce sums the parts
LM head:     each rank scores its rows, all-gather concatenates, padding columns are cut
```
A tied LM head shares the embedding's weight parameter. `ScaledVocabEmbedding` multiplies the
looked-up rows by a constant (Gemma: sqrt(hidden_size), rounded to the model dtype first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from aserve.layers.bind import PackableLinear


class VocabEmbedding(nn.Module):
    """Embedding table [vocab_size, embedding_dim]; this rank holds a contiguous slice of rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed_rows = None  # see `use_packed_rows`

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch: embedding ({self.num_embeddings}, "
                             f"{param.shape[1]}), checkpoint {tuple(loaded.shape)}.")
        rows = max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def use_packed_rows(self, packed) -> None:
        """Look rows up in a packed weight that reads them back (`rows(ids)`: a quantized
        checkpoint's embedding kept as integers), dropping the float copy (tp = 1)."""
        self.packed_rows, self.rows_dtype = packed, self.weight.dtype
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_rows is not None:
            rows = self.packed_rows.rows(input_ids).to(self.rows_dtype)
            return rows.view(*input_ids.shape, rows.shape[-1])  # [T, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, embedding_dim]
        local = input_ids - self.vocab_start  # [T]
        owned = (local >= 0) & (local < self.rows_per_rank)  # [T]
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        return tp_all_reduce(out * owned.unsqueeze(-1).to(out.dtype))  # [T, embedding_dim]


class ScaledVocabEmbedding(VocabEmbedding):
    """`VocabEmbedding` times `embed_scale`, the scale held in the default dtype at
    construction (the model dtype, as HF's `Gemma*TextScaledWordEmbedding` rounds it)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale  # [T, embedding_dim]


class LMHead(VocabEmbedding, PackableLinear):
    """Scores hidden states against the vocabulary: [N, hidden] -> [N, vocab_size]. A packed
    copy (`set_packed`) sits beside the weight, which the embedding may share."""

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (tied word embeddings)."""
        self.weight = embedding.weight
        self.tied_embedding = embedding

    def set_packed(self, packed) -> None:
        """Packed beside the weight; a packed weight that reads rows back (integers) serves a
        tied embedding's lookups too, and the float weight goes."""
        super().set_packed(packed)
        embedding = getattr(self, "tied_embedding", None)
        if embedding is not None and hasattr(packed, "rows"):
            embedding.use_packed_rows(packed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] logits: the weight's dtype, or (a packed weight) the
        same values already in float32, written once instead of rounded then widened."""
        if self.packed_weight is not None:
            logits = self.packed_weight.linear_float(hidden)  # [N, rows_per_rank] float32
        else:
            logits = F.linear(hidden, self.weight)  # [N, rows_per_rank]
        logits = tp_all_gather(logits, dim=-1)  # [N, rows_per_rank * tp_size]
        return logits[..., : self.num_embeddings]  # [N, vocab_size]
