"""What every decoder-only model shares around its `DecoderStack` (`layers/decoder_stack.py`:
a pipeline stage's layers, the embedding and the final norm): the LM head (tied or not), the
packed-projection rename table, which checkpoint tensors a pipeline stage owns, logits, and the
attention layers the runner binds. A family file builds its stack from its own parts
(`build_stack`) and subclasses `CausalLM` once.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from aserve.layers.attention import Attention, AttentionMetadata
from aserve.layers.decoder_stack import DecoderStack
from aserve.layers.embedding import LMHead
from aserve.models.arch_config import ModelArchConfig


class CausalLM(nn.Module):
    """Build it under the target default dtype and device (the loader does); parameters are
    empty until weights are loaded. `lm_head=False` (the pooling runner's: embeddings from the
    final hidden states) builds none, and the checkpoint's, if any, is skipped."""

    # checkpoint module name -> (packed module name, shard id for its weight_loader)
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # checkpoint name prefix -> this model's (None: a tensor the model skips), tried first
    checkpoint_prefixes: ClassVar[dict[str, str | None]] = {}
    # A bare decoder's checkpoint (HF's `*Model`, e.g. Qwen3-Embedding) names the stack's
    # tensors without `model.`: tried after `checkpoint_prefixes`
    bare_prefixes: ClassVar[dict[str, str]] = {
        "embed_tokens.": "model.embed_tokens.", "layers.": "model.layers.",
        "norm.": "model.norm."}
    # (regex, replacement) applied to every checkpoint name, after `checkpoint_prefixes`
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, arch: ModelArchConfig, lm_head: bool = True) -> None:
        super().__init__()
        self.arch = arch
        self.model = self.build_stack(arch)
        self.lm_head = None
        if self.model.is_last and lm_head:
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size)
            if arch.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def build_stack(self, arch: ModelArchConfig) -> DecoderStack:
        """The family's decoder stack (this pipeline stage's share of it)."""
        raise NotImplementedError

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
