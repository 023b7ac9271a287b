"""The Gemma family: Gemma-2 and Gemma-3 (text; also the text tower of a
`Gemma3ForConditionalGeneration` checkpoint). Siblings differ only by flags read from
`ModelArchConfig`: Gemma-3 adds q/k norms and a rope of its own for sliding layers; Gemma-2
soft-caps its attention scores.

```
embed: x = embed_tokens(ids) * sqrt(hidden)            (the scale rounded to the model dtype)
layer: r = x;  x = r + post_attention_norm(attn(input_norm(x)))
       r = x;  x = r + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
attn:  `LlamaAttention` with Gemma's norm: q/k/v, [Gemma-3: q_norm / k_norm], rope (Gemma-3:
       the sliding layers' own base), scale query_pre_attn_scalar ** -0.5, [Gemma-2:
       soft-capped scores], each layer's window (`arch.layer_windows`)
mlp:   down(gelu_tanh(gate(x)) * up(x))
head:  final_norm, tied LM head, [cap * tanh(logits / cap)]
```
Every norm is Gemma's RMSNorm (scale 1 + weight, in float32). Between layers (and pipeline
stages) the residual stream travels as (hidden, residual) like Llama's: the layer's last add is
done by the next layer (or the final norm), which is the same sum HF computes.

Parameter names are HF's, except the packed projections of `packed_modules` (as in Llama);
`checkpoint_prefixes` maps a multimodal checkpoint's text-tower names onto them and skips its
vision tower. The sandwich layers are not the pre-norm form a platform may run whole
(`backends.ops`): they always run module by module.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.activation import GeluTanhAndMul
from aserve.layers.attention import AttentionMetadata
from aserve.layers.decoder_stack import DecoderStack
from aserve.layers.embedding import ScaledVocabEmbedding
from aserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from aserve.layers.norm import GemmaRMSNorm
from aserve.layers.rotary import RotaryEmbedding, get_rope
from aserve.models.arch_config import ModelArchConfig
from aserve.models.causal_lm import CausalLM
from aserve.models.llama import LlamaAttention


class GemmaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size],
                                                       bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, bias=arch.mlp_bias)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, hidden]


class GemmaDecoderLayer(nn.Module):
    """Attention then MLP, each between a pre-norm and a post-norm ("sandwich" norms)."""

    def __init__(self, arch: ModelArchConfig, rotary_emb: RotaryEmbedding,
                 layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, rotary_emb, arch.layer_windows[layer_idx],
                                        GemmaRMSNorm)
        self.mlp = GemmaMLP(arch)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, attn_metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:  # the previous layer's last residual add
            hidden = residual + hidden
        residual = hidden
        hidden = self.self_attn(positions, self.input_layernorm(hidden), attn_metadata)
        hidden = residual + self.post_attention_layernorm(hidden)
        residual = hidden
        hidden = self.mlp(self.pre_feedforward_layernorm(hidden))
        return self.post_feedforward_layernorm(hidden), residual  # [T, hidden] each


class GemmaForCausalLM(CausalLM):
    """Serves Gemma2ForCausalLM, Gemma3ForCausalLM and the text of
    Gemma3ForConditionalGeneration; the runner treats it as it does `LlamaForCausalLM`."""

    # checkpoint name prefix -> this model's (None: a part not served, skipped). A
    # Gemma3ForConditionalGeneration checkpoint names its text tower either way.
    checkpoint_prefixes = {
        "model.language_model.": "model.",
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "model.vision_tower.": None,
        "vision_tower.": None,
        "model.multi_modal_projector.": None,
        "multi_modal_projector.": None,
    }

    def build_stack(self, arch: ModelArchConfig) -> DecoderStack:
        dtype = torch.get_default_dtype()
        rope = (arch.head_dim, arch.rotary_dim, arch.max_position_embeddings)
        rotary_emb = get_rope(*rope, arch.rope_theta, arch.rope_scaling, dtype)
        local_rotary_emb = rotary_emb  # the sliding layers' (Gemma-3: its own base)
        if arch.local_rope_theta is not None:
            local_rotary_emb = get_rope(*rope, arch.local_rope_theta, arch.local_rope_scaling,
                                        dtype)

        def layer(i: int) -> GemmaDecoderLayer:
            sliding = arch.layer_types and arch.layer_types[i] == "sliding_attention"
            return GemmaDecoderLayer(arch, local_rotary_emb if sliding else rotary_emb, i)

        return DecoderStack(
            arch.num_layers, layer,
            embedding=lambda: ScaledVocabEmbedding(arch.vocab_size, arch.hidden_size,
                                                   arch.hidden_size**0.5),
            norm=lambda: GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps),
            tied_embedding=arch.tie_word_embeddings, rotary_emb=rotary_emb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab], soft-capped where the model says."""
        logits = self.lm_head(hidden)  # [N, vocab]
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
