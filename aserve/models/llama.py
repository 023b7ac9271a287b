"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm over head_dim,
before rope), and their mixtures of experts, Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss (a
layer's MLP is a `SparseMoeBlock` where `arch.moe` says so; gpt-oss adds biases everywhere and
attention sinks, alternates windowed and full layers and scales its rope with YaRN). Siblings
differ only by flags read from `ModelArchConfig`.

Parameter names are HF's, except the packed projections listed in `packed_modules`:
q_proj/k_proj/v_proj load into `qkv_proj` and gate_proj/up_proj into `gate_up_proj`. Under
pipeline parallelism a rank builds only its stage's layers (`owns_weight` tells the loader which
checkpoint tensors are its own).
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.activation import SiluAndMul
from aserve.layers.attention import AttentionMetadata
from aserve.layers.decoder_stack import DecoderStack
from aserve.layers.embedding import VocabEmbedding
from aserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from aserve.layers.moe import SparseMoeBlock
from aserve.layers.norm import RMSNorm
from aserve.layers.rotary import RotaryEmbedding, get_rope
from aserve.layers.ulysses import make_attention
from aserve.models.arch_config import ModelArchConfig
from aserve.models.causal_lm import CausalLM


class LlamaAttention(nn.Module):
    """q/k/v projections, optional q/k norms over head_dim (`norm_cls`: Gemma brings its own),
    rope, attention (scale head_dim ** -0.5 unless `query_pre_attn_scalar`; the layer's window;
    the model's soft-cap; gpt-oss' per-head sinks), o_proj."""

    def __init__(self, arch: ModelArchConfig, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None = None,
                 norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, d, arch.num_heads, arch.num_kv_heads,
                                          bias=arch.attention_bias)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads  # this TP rank's
        self.q_size, self.kv_size = num_heads * d, num_kv_heads * d
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size,
                                        bias=arch.o_proj_bias)
        self.q_norm = norm_cls(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = norm_cls(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary_emb = rotary_emb
        scale = (arch.query_pre_attn_scalar or d) ** -0.5
        self.attn = make_attention(num_heads, num_kv_heads, d, scale, sliding_window,
                                   arch.attn_logit_softcapping)
        self.sinks = None  # gpt-oss: [num_heads] float32, this rank's heads
        if arch.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                      requires_grad=False)
            self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size, rank = param.shape[0], self.qkv_proj.tp_rank
        default_weight_loader(param, loaded.narrow(0, rank * size, size))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            d = self.attn.head_dim
            q = self.q_norm(q.reshape(-1, self.num_heads, d)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, d)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)  # [T, q_size], [T, kv_size]
        if self.sinks is not None:
            return self.o_proj(self.attn(q, k, v, attn_metadata, sinks=self.sinks))
        return self.o_proj(self.attn(q, k, v, attn_metadata))  # [T, hidden]


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `intermediate_size` other than the model's for a MoE
    block's shared expert, whose partial sum (`reduce_results=False`) the block reduces."""

    def __init__(self, arch: ModelArchConfig, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        size = intermediate_size or arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size],
                                                       bias=arch.mlp_bias, silu_gated=True)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, bias=arch.mlp_bias,
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x)  # fused into the GEMM where it can be
        if act is None:
            act = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(act)  # [T, hidden]


def make_mlp(arch: ModelArchConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: a MoE block where the model is sparse there (with Qwen2-MoE's
    shared expert), else the dense one."""
    moe = arch.moe
    if moe is None or not moe.sparse_layers[layer_idx]:
        return LlamaMLP(arch)
    shared = (LlamaMLP(arch, moe.shared_expert_intermediate_size, reduce_results=False)
              if moe.shared_expert_intermediate_size else None)
    return SparseMoeBlock(moe, arch.hidden_size, shared)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP (or MoE block): the pre-norm form of `backends.ops`, which a
    platform may run whole (`DecoderStack(pre_norm=True)`)."""

    def __init__(self, arch: ModelArchConfig, rotary_emb: RotaryEmbedding,
                 layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, rotary_emb, arch.layer_windows[layer_idx])
        self.mlp = make_mlp(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, attn_metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and the mixtures of
    experts MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, GptOssForCausalLM."""

    # Mixtral's MoE block, gpt-oss' router
    checkpoint_renames = ((r"\.block_sparse_moe\.", ".mlp."), (r"\.mlp\.router\.", ".mlp.gate."))

    def build_stack(self, arch: ModelArchConfig) -> DecoderStack:
        rotary_emb = get_rope(arch.head_dim, arch.rotary_dim, arch.max_position_embeddings,
                              arch.rope_theta, arch.rope_scaling, torch.get_default_dtype())
        return DecoderStack(
            arch.num_layers, lambda i: LlamaDecoderLayer(arch, rotary_emb, i),
            embedding=lambda: VocabEmbedding(arch.vocab_size, arch.hidden_size),
            norm=lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps),
            tied_embedding=arch.tie_word_embeddings, rotary_emb=rotary_emb, pre_norm=True)
