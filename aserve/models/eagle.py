"""EAGLE draft heads (speculative decoding's `eagle` and `eagle3` methods) in the checkpoint
formats vLLM loads. A head is one (or a few) Llama decoder layers fed by the target's hidden
states; it drafts the token after next from (the target's hidden state at p, the token at
p + 1), and then from its own output:

    EAGLE-1   x = fc([embed(t_{p+1}), h_p])          h_p: the target's final (normed) hidden
              layers (layer 0 without input norm) -> y = hidden + residual
              logits = target.lm_head(y); the next pass takes (embed(d), y)
    EAGLE-3   x = fc([a_p, b_p, c_p])                 three of the target's residual streams
              layer 0: attention over [input_norm(embed(t_{p+1})), hidden_norm(x)] (2H wide)
              later layers as Llama's; y, y_prenorm = norm(hidden, residual)
              logits = lm_head(y) over `draft_vocab_size` tokens, mapped to the target's
              (`d2t`: target id = draft id + d2t[draft id]); the next pass takes
              (embed(d), y_prenorm) without fc

Checkpoint names: EAGLE-1's `fc.weight` (and `fc.bias` where the checkpoint has one),
`layers.N.*`, optionally `embed_tokens.weight` (the target's embedding is used: vLLM shares
it too), HASS's `embedding_layernorm` / `hidden_states_layernorm` where config.json says
`add_para_norm`; EAGLE-3's `midlayer.*` (layer 0) or `layers.N.*`, `fc.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, optionally `embed_tokens.weight` (else the target's); `t2d` is
unused. A leading `model.` is dropped. Weights: safetensors, or `pytorch_model.bin` (read
with `weights_only`). The auxiliary layers come from config.json's
`eagle_config.eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3) of the target's L
layers, as vLLM takes them; their residual streams (the input of each layer) are in layer order.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aserve.layers.attention import AttentionMetadata
from aserve.layers.embedding import LMHead, VocabEmbedding
from aserve.layers.linear import QKVParallelLinear, ReplicatedLinear, load_into
from aserve.layers.norm import RMSNorm
from aserve.layers.rotary import get_rope
from aserve.models.arch_config import ModelArchConfig
from aserve.models.causal_lm import CausalLM
from aserve.models.llama import LlamaDecoderLayer
from aserve.models.loader import packed_target

EAGLE_METHODS = ("eagle", "eagle3")
_PACKED = CausalLM.packed_modules  # checkpoint q/k/v, gate/up -> the packed projections


def read_eagle_config(model_dir: Path) -> dict[str, Any]:
    """config.json of an EAGLE head's directory."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in the EAGLE head's directory "
                                f"{model_dir}.")
    return json.loads(config_path.read_text())


def read_eagle_checkpoint(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and the tensors of an EAGLE head's directory (names without `model.`)."""
    config = read_eagle_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for path in files:
            tensors.update(load_file(str(path)))
    else:
        bins = sorted(model_dir.glob("pytorch_model*.bin"))
        if not bins:
            raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin weights in the "
                                    f"EAGLE head's directory {model_dir}.")
        for path in bins:
            tensors.update(torch.load(path, map_location="cpu", weights_only=True))
    return config, {name.removeprefix("model."): t for name, t in tensors.items()}


def uses_aux_hidden(config: dict[str, Any], version: int) -> bool:
    """Whether the head's fc reads three of the target's residual streams (EAGLE-3's default)
    rather than its final hidden states."""
    return version == 3 and bool((config.get("eagle_config") or {}).get("use_aux_hidden_state",
                                                                         True))


def aux_layer_ids(config: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE-3's fc reads, in layer order."""
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_layers // 2, target_layers - 3)
    ids = tuple(sorted(int(i) for i in ids))
    if (not ids or len(set(ids)) < len(ids)
            or not all(0 <= i < target_layers for i in ids)):
        raise ValueError(f"the EAGLE-3 head reads the target's layers {list(ids)}, which "
                         f"are not distinct layers of the target's {target_layers} (give "
                         "eagle_config."
                         "eagle_aux_hidden_state_layer_ids in its config.json).")
    return ids


class _Eagle3FirstLayer(LlamaDecoderLayer):
    """EAGLE-3's layer 0: attention over [input_norm(embeds), hidden_norm(hidden)]."""

    def __init__(self, arch: ModelArchConfig, rotary_emb, norm_before_residual: bool) -> None:
        super().__init__(arch, rotary_emb, 0)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, bias=arch.attention_bias)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward_first(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                      metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.input_layernorm(embeds)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        out = self.self_attn(positions, torch.cat([embeds, normed], dim=-1), metadata)
        out, residual = self.post_attention_layernorm(out, residual.clone())
        return self.mlp(out), residual


class EagleHead(nn.Module):
    """An EAGLE-1 (`version` 1) or EAGLE-3 (3) head on `target`'s embedding (and, EAGLE-1, LM
    head); build under the target's dtype and device, then `load`."""

    def __init__(self, config: dict[str, Any], version: int, target: nn.Module,
                 own_embedding: bool = False) -> None:
        super().__init__()
        try:
            arch = ModelArchConfig.from_hf({"architectures": ["LlamaForCausalLM"], **config,
                                            "vocab_size": target.arch.vocab_size})
        except KeyError as e:
            raise ValueError(f"the EAGLE head's config.json lacks required key {e}.") from None
        max_pos = max(arch.max_position_embeddings, target.arch.max_position_embeddings)
        self.arch = replace(arch, layer_types=(), moe=None,  # full attention, dense
                            max_position_embeddings=max_pos)
        self.version = version
        arch, target_hidden = self.arch, target.arch.hidden_size
        rope = get_rope(arch.head_dim, arch.rotary_dim, arch.max_position_embeddings,
                        arch.rope_theta, arch.rope_scaling, torch.get_default_dtype())
        self.num_aux = 0
        if version == 1:
            if arch.hidden_size != target_hidden:
                raise ValueError(f"the EAGLE head's hidden size {arch.hidden_size} is not the "
                                 f"target's ({target_hidden}).")
            layers = [LlamaDecoderLayer(arch, rope, i) for i in range(arch.num_layers)]
            layers[0].input_layernorm = nn.Identity()
            self.fc = ReplicatedLinear(2 * arch.hidden_size, arch.hidden_size, bias=True)
            self.para_norms = None
            if config.get("add_para_norm"):
                self.para_norms = nn.ModuleList(RMSNorm(arch.hidden_size, arch.rms_norm_eps)
                                                for _ in range(2))
        else:
            source = config.get("target_hidden_size") or target_hidden
            if source != target_hidden:
                raise ValueError(f"the EAGLE-3 head reads hidden states of {source}, the "
                                 f"target's are {target_hidden}.")
            self.num_aux = 3 if uses_aux_hidden(config, version) else 0
            first = _Eagle3FirstLayer(arch, rope, bool(config.get("norm_before_residual")))
            layers = [first, *(LlamaDecoderLayer(arch, rope, i)
                               for i in range(1, arch.num_layers))]
            self.fc = (ReplicatedLinear(self.num_aux * target_hidden, arch.hidden_size,
                                        bias=False) if self.num_aux else None)
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.draft_vocab_size = config.get("draft_vocab_size") or arch.vocab_size
            self.lm_head = LMHead(self.draft_vocab_size, arch.hidden_size)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.layers = nn.ModuleList(layers)
        # the target's modules, not registered here (bound and packed as the target's)
        self._target = (target.model.embed_tokens, target.lm_head)  # (a tuple: unregistered)
        # EAGLE-3's own embedding where its checkpoint has one (EAGLE-1 uses the target's)
        self.embed_tokens = (VocabEmbedding(arch.vocab_size, arch.hidden_size)
                             if own_embedding and version == 3 else None)

    def read_vocabulary(self, embedding: nn.Module, lm_head: nn.Module) -> None:
        """Read these (whole) tables instead of the target's modules: under tensor or pipeline
        parallelism those are shards, or on another rank (`runner/spec_eagle.py`)."""
        self._target = (embedding, lm_head)

    # ------------------------------------------------------------------ weights

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """The head's tensors (names without `model.`); error naming any left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | int | None]] = set()
        for stored, tensor in tensors.items():
            name = stored.replace("midlayer.", "layers.0.", 1)
            if self.version == 1:
                name = name.replace("embedding_layernorm.", "para_norms.0.")
                name = name.replace("hidden_states_layernorm.", "para_norms.1.")
            if name == "d2t" and self.version == 3:
                if tensor.shape != self.d2t.shape:
                    raise ValueError(f"the EAGLE-3 head's d2t has shape {tuple(tensor.shape)}, "
                                     f"its draft vocabulary {self.draft_vocab_size}.")
                self.d2t.copy_(tensor.to(torch.long))
                continue
            name, shard = packed_target(name, _PACKED)
            if name not in params:
                continue  # t2d, a shared embedding EAGLE-1 does not use, rotary buffers
            try:
                load_into(params[name], tensor, shard)
            except ValueError as e:
                raise ValueError(f"cannot load the EAGLE head's {stored}: {e}") from None
            loaded.add((name, shard))
        if self.version == 1 and ("fc.bias", None) not in loaded:  # a head without one
            self.fc.bias.data.zero_()
            loaded.add(("fc.bias", None))
        expected = set()
        for name in params:
            shards = [(name, s) for p, s in _PACKED.values() if f".{p}." in name]
            expected.update(shards or [(name, None)])
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"the EAGLE head's checkpoint lacks {len(missing)} weight(s): "
                             f"{', '.join(missing[:8])}.")

    # ------------------------------------------------------------------ forward

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The head's token embedding: its own, or the target's table unscaled (a Gemma
        target scales its rows in the model, not in the table, as vLLM's heads read it)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return VocabEmbedding.forward(self._target[0], input_ids)

    def combine(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        """The target's hidden states of a row (EAGLE-1: its final hidden; EAGLE-3: its
        auxiliary streams) -> the head's input hidden [N, H]."""
        if self.version == 1:
            return target_hidden[0]
        if self.fc is None:
            return target_hidden[-1]
        return self.fc(torch.cat(target_hidden, dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T], positions [T], hidden [T, H]) -> (what the logits read, what the next
        pass takes), both [T, H]."""
        embeds = self.embed(input_ids)
        if self.version == 1:
            if self.para_norms is not None:
                embeds, hidden = self.para_norms[0](embeds), self.para_norms[1](hidden)
            x, residual = self.fc(torch.cat([embeds, hidden], dim=-1)), None
            for layer in self.layers:
                x, residual = layer(positions, x, residual, metadata)
            out = x + residual
            return out, out
        x, residual = self.layers[0].forward_first(positions, embeds, hidden, metadata)
        for layer in self.layers[1:]:
            x, residual = layer(positions, x, residual, metadata)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> float32 logits [N, draft vocab] (EAGLE-3: map argmaxes with `to_target`)."""
        head = self._target[1] if self.version == 1 else self.lm_head
        return head(hidden).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.version == 1 else draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list:
        return [layer.self_attn.attn for layer in self.layers]
