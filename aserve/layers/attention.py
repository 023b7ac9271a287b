"""The attention layer: writes this step's K/V into the paged cache, then attends over it.

The runner binds each layer's cache `[2, num_blocks, block_size, num_kv_heads, head_dim]` and
its KV cache group through `bind_kv_cache`; until then (memory profiling) the layer runs plain
causal attention inside each request's rows. Under a hybrid KV cache every group has its own
block table and slot mapping (`AttentionMetadata.for_group`); layers of different groups may
share one buffer, since a block id belongs to one group at a time. Its kernels (`store_kv`,
`paged_attention`, or `attention_forward` for both) are the bound `self.ops`; the layer never
asks which device it is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aserve.layers.bind import OpsLayer


@dataclass
class AttentionMetadata:
    """Where each token of a ragged batch of R requests (T tokens) sits and what it attends.

    query_start_loc: [R+1] int32, request r owns token rows query_start_loc[r]:[r+1], which are
        the last q_len tokens of its sequence.
    seq_lens: [R] int32, tokens in each sequence after this step (computed + scheduled).
    block_table: [R, M] int32, each request's block ids; entries past its need are ignored.
    slot_mapping: [T] int64, cache slot (block_id * block_size + offset) for each token's K/V;
        -1 for padding tokens, which are not written.
    max_query_len / max_seq_len: maxima of the above, as ints (no device sync needed).
    query_start_loc_cpu / seq_lens_cpu: optional host copies (python lists) of the first two;
        when present the reference kernel reads them instead of copying back from the device.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # What a kernel plans once per step and every layer reuses (see KernelOps.attention_forward).
    kernel_plan: object = None
    # Under a hybrid KV cache, every group's metadata in group order (the same query layout,
    # each group's own block table and slot mapping); empty: one group, this one.
    group_metadata: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group`."""
        return self.group_metadata[group] if self.group_metadata else self


class Attention(OpsLayer):
    """Multi-head attention core over the paged KV cache: q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D].

    GQA when num_heads > num_kv_heads. `sliding_window` W: query position p sees key j iff
    p - j < W (HF's mask), its W latest keys; `soft_cap`: scores are squashed to
    cap * tanh(s / cap). Attention sinks (gpt-oss) come with each call (`forward`'s `sinks`).
    """

    exchanges_heads = False  # True: rows travel between ranks around it (`UlyssesAttention`)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} kv heads.")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.kv_cache: torch.Tensor | None = None  # [2, NB, BS, Hkv, D], bound by the runner
        self.kv_group = 0  # the KV cache group whose block table this layer reads

    def bind_kv_cache(self, kv_cache: torch.Tensor, kv_group: int = 0) -> None:
        """Attend over `kv_cache` [2, NB, BS, Hkv, D], through group `kv_group`'s block table."""
        self.kv_cache, self.kv_group = kv_cache, kv_group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_metadata: AttentionMetadata, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`sinks`: None, or float32 [num_heads] (this rank's query heads): one logit per head
        that joins every row's softmax and carries no value (gpt-oss; `paged_attention_ref`),
        handed to whichever op runs. The profiling forward, with no cache bound, ignores them
        (as it ignores the window and the cap: it only has to touch the memory a step does)."""
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.kv_cache is None:
            out = self._profile_forward(q, k, v, attn_metadata)
        else:
            m, ops = attn_metadata.for_group(self.kv_group), self.ops
            if ops.attention_forward is not None:  # store and attend in one kernel call each
                out = ops.attention_forward(q, k, v, self.kv_cache[0], self.kv_cache[1], m,
                                            self.scale, self.sliding_window, self.soft_cap,
                                            sinks=sinks)
                return out.view(-1, self.num_heads * self.head_dim)
            ops.store_kv(k, v, self.kv_cache[0], self.kv_cache[1], m.slot_mapping)
            out = ops.paged_attention(
                q, self.kv_cache[0], self.kv_cache[1], m.query_start_loc, m.seq_lens,
                m.block_table, self.scale, self.sliding_window, self.soft_cap,
                query_start_loc_cpu=m.query_start_loc_cpu, seq_lens_cpu=m.seq_lens_cpu,
                key=k, value=v, sinks=sinks)
        return out.view(-1, self.num_heads * self.head_dim)  # [T, Hq*D]

    def _profile_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         attn_metadata: AttentionMetadata) -> torch.Tensor:
        """No cache: plain causal attention within each request's rows (window, cap and sinks
        ignored)."""
        starts = attn_metadata.query_start_loc_cpu or attn_metadata.query_start_loc.tolist()
        out = torch.zeros_like(q)  # [T, Hq, D]
        for start, end in zip(starts[:-1], starts[1:], strict=True):
            if end == start:
                continue
            qr, kr, vr = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
