"""What every decoder-only model shares. `DecoderStack.forward`: embed (first pipeline stage)
or take the previous stage's (hidden, residual), run this stage's layers, apply the final norm
(last stage). `CausalLM`: around the stack, the LM head (tied or not), the packed-projection
rename table, which checkpoint tensors a pipeline stage owns, logits, and the attention layers
the runner binds. A family file builds its stack's parts (`DecoderStack` subclass: embedding,
layers, final norm, its stage's share) and subclasses `CausalLM` once.
"""

from __future__ import annotations

import itertools
import re
from typing import ClassVar

import torch
from torch import nn

from aserve.backends.ops import DecoderLayerFn
from aserve.layers.attention import Attention, AttentionMetadata
from aserve.layers.embedding import LMHead
from aserve.models.arch_config import ModelArchConfig


class DecoderStack(nn.Module):
    """The decoder stack, or this pipeline stage's share of it. A subclass's `__init__` sets
    `is_first`, `is_last`, `embed_tokens` (None where unused), `owned` (this stage's layer
    range), `layers` (every index; others' a stand-in) and `norm` (last stage: called as
    `norm(hidden, residual) -> (normed, hidden + residual)`)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[T] ids (first stage) or the previous stage's (hidden, residual) -> final hidden
        states [T, hidden] (last stage) or this stage's (hidden, residual)."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate
        layers = itertools.islice(self.layers, self.owned.start, self.owned.stop)
        fast = self._fast_stack()
        if fast is not None:
            stack, group = fast
            out = stack(positions, hidden, residual, attn_metadata.for_group(group))
            if out is not None:
                (hidden, residual), layers = out, ()
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [T, hidden]

    def _fast_stack(self) -> tuple[DecoderLayerFn, int] | None:
        """This stage's layers as one call (`ops.decoder_stack`) and their KV cache group, where
        every layer has a whole-layer call (a layer's `fast_path()`) in one group and the
        platform stacks them; None otherwise. Rebuilt when the first layer's call is (its KV
        cache rebound: every layer's is rebound with it)."""
        first = self.layers[self.owned.start]
        head = first.fast_path() if hasattr(first, "fast_path") else None
        if head is None:
            return None
        cached = getattr(self, "_stack_cache", None)
        if cached is None or cached[0] is not head:
            layers = itertools.islice(self.layers, self.owned.start, self.owned.stop)
            paths = [layer.fast_path() if hasattr(layer, "fast_path") else None
                     for layer in layers]
            make = first.ops.decoder_stack
            stack = None
            if make is not None and None not in paths and len({g for _, g in paths}) == 1:
                stack = make([fn for fn, _ in paths])
            cached = (head, None if stack is None else (stack, head[1]))
            self._stack_cache = cached
        return cached[1]


class CausalLM(nn.Module):
    """Build it under the target default dtype and device (the loader does); parameters are
    empty until weights are loaded."""

    model_cls: ClassVar[type[nn.Module]]
    # checkpoint module name -> (packed module name, shard id for its weight_loader)
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # (regex, replacement) applied to every checkpoint name, after `checkpoint_prefixes`
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = self.model_cls(arch)
        self.lm_head = None
        if self.model.is_last:
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size)
            if arch.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden] (last stage), or
        this stage's (hidden, residual) for the next one."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def owns_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (HF's name, after any prefix renaming) belongs to
        this pipeline stage."""
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            return int(match.group(1)) in self.model.owned
        parts = {"model.embed_tokens.": self.model.embed_tokens, "model.norm.": self.model.norm,
                 "lm_head.": self.lm_head}
        return next((part is not None for prefix, part in parts.items()
                     if name.startswith(prefix)), True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        """The attention modules in layer order; the runner binds `kv_cache` on each."""
        return [self.model.layers[i].self_attn.attn for i in self.model.owned]
