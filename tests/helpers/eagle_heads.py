"""Tiny random-weight EAGLE heads in the checkpoint formats vLLM loads, and a reference that
drafts with them from HF transformers' target model: no cache, every pass over the whole
history, the head's layers HF's own Llama modules.

EAGLE-1 (`version` 1): `fc` over [embed(t_{p+1}), h_p] (h: the target's final normed hidden
states), Llama layers whose first has no input norm, the target's LM head on hidden + residual.
EAGLE-3 (3): `fc` over three of the target's residual streams (the inputs of the layers
`aux_ids`), a first layer attending over [input_norm(embed), hidden_norm(x)], a final norm, an
LM head over `draft_vocab` tokens mapped to the target's by `d2t`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from aserve.runner.spec_eagle import EagleDrafter

HEAD_STD = 0.3


def head_config(target_config: dict, version: int, *, layers: int = 1,
                aux_ids: list[int] | None = None, draft_vocab: int | None = None) -> dict:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta",
            "rope_parameters", "bos_token_id", "eos_token_id")
    config = {k: target_config[k] for k in keys if k in target_config}
    config.update(architectures=["LlamaForCausalLMEagle3" if version == 3 else
                                 "LlamaForCausalLM"], model_type="llama",
                  intermediate_size=96, num_hidden_layers=layers, torch_dtype="float32")
    if version == 3:
        config["draft_vocab_size"] = draft_vocab or config["vocab_size"]
        if aux_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    return config


def make_eagle_head(out_dir: str | Path, target_dir: str | Path, version: int, *,
                    seed: int = 0, layers: int = 1, aux_ids: list[int] | None = None,
                    draft_vocab: int | None = None, fmt: str = "safetensors",
                    prefix: str = "", midlayer: bool = True, fc_bias: bool = True,
                    own_embedding: bool = False) -> Path:
    """An EAGLE head for the target in `target_dir`. `fmt`: safetensors or bin
    (pytorch_model.bin); `prefix`: put before every name (`model.`); `midlayer`: EAGLE-3's layer
    0 as `midlayer.*` (else `layers.0.*`); `fc_bias`: EAGLE-1's fc has a bias (the original
    checkpoints do)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = head_config(target, version, layers=layers, aux_ids=aux_ids,
                         draft_vocab=draft_vocab)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * HEAD_STD

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    h, d = config["hidden_size"], config.get("head_dim") or 16
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        name = "midlayer" if version == 3 and i == 0 and midlayer else f"layers.{i}"
        width = 2 * h if version == 3 and i == 0 else h
        tensors.update({
            f"{name}.self_attn.q_proj.weight": rand(heads * d, width) / width ** 0.5 * 4,
            f"{name}.self_attn.k_proj.weight": rand(kv * d, width) / width ** 0.5 * 4,
            f"{name}.self_attn.v_proj.weight": rand(kv * d, width),
            f"{name}.self_attn.o_proj.weight": rand(h, heads * d),
            f"{name}.mlp.gate_proj.weight": rand(inter, h),
            f"{name}.mlp.up_proj.weight": rand(inter, h),
            f"{name}.mlp.down_proj.weight": rand(h, inter),
            f"{name}.post_attention_layernorm.weight": norm(h),
        })
        if version == 3 or i > 0:
            tensors[f"{name}.input_layernorm.weight"] = norm(h)
        if version == 3 and i == 0:
            tensors[f"{name}.hidden_norm.weight"] = norm(h)
    if version == 1:
        tensors["fc.weight"] = rand(h, 2 * h) / (2 * h) ** 0.5
        if fc_bias:
            tensors["fc.bias"] = rand(h)
    else:
        draft_vocab = config["draft_vocab_size"]
        tensors["fc.weight"] = rand(h, 3 * h) / (3 * h) ** 0.5
        tensors["norm.weight"] = norm(h)
        tensors["lm_head.weight"] = rand(draft_vocab, h)
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, h)
    tensors = {(name if name in ("d2t", "t2d") else prefix + name): t.contiguous()
               for name, t in tensors.items()}
    if fmt == "bin":
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file(tensors, str(out / "model.safetensors"))
    return out


class EagleReference:
    """Drafts of an EAGLE head from HF's target, recomputed from scratch for a history."""

    def __init__(self, target_dir: str | Path, head_dir: str | Path, version: int,
                 aux_ids: list[int] | None = None) -> None:
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        from helpers.hf_models import load_hf_model

        self.target = load_hf_model(target_dir)
        self.version, self.aux_ids = version, aux_ids
        config = json.loads((Path(head_dir) / "config.json").read_text())
        hf = LlamaConfig(**{k: v for k, v in config.items() if k != "eagle_config"})
        hf._attn_implementation = "eager"
        path = Path(head_dir) / "model.safetensors"
        weights = (load_file(str(path)) if path.exists() else
                   torch.load(Path(head_dir) / "pytorch_model.bin", weights_only=True))
        weights = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v
                   for k, v in weights.items()}
        self.layers = []
        h = hf.hidden_size
        for i in range(hf.num_hidden_layers):
            layer = LlamaDecoderLayer(hf, layer_idx=i).eval()
            if version == 3 and i == 0:
                attn = layer.self_attn
                for proj in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(attn, proj)
                    setattr(attn, proj, torch.nn.Linear(2 * h, old.out_features, bias=False))
                layer.hidden_norm = torch.nn.Module()
                layer.hidden_norm.weight = weights[f"layers.{i}.hidden_norm.weight"]
            if version == 1 and i == 0:
                layer.input_layernorm = torch.nn.Identity()
            own = {k.removeprefix(f"layers.{i}."): v for k, v in weights.items()
                   if k.startswith(f"layers.{i}.") and "hidden_norm" not in k}
            layer.load_state_dict(own, strict=True)
            self.layers.append(layer)
        self.rope = LlamaRotaryEmbedding(hf)
        self.eps = hf.rms_norm_eps
        self.weights = weights

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.weights.get("embed_tokens.weight")
        if own is not None and self.version == 3:
            return own[ids]
        return self.target.model.embed_tokens.weight[ids]  # the table unscaled (vLLM's heads
        # read a Gemma target's embedding before its scale; HF scales inside the module)

    @torch.no_grad()
    def _head(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a whole sequence: (logits of the last row in the target's vocabulary,
        every row's carry)."""
        t = len(ids)
        positions = torch.arange(t)[None]
        cos_sin = self.rope(hidden[None], positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        embeds = self._embed(ids)[None]
        x = hidden[None]
        w = self.weights
        if self.version == 1:
            x = torch.cat([embeds, x], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
            for layer in self.layers:
                x = layer(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=cos_sin)
            return self.target.lm_head(x[0, -1]), x[0]
        first = self.layers[0]
        e = first.input_layernorm(embeds)
        n = self._rms(x, first.hidden_norm.weight)
        attn, _ = first.self_attn(torch.cat([e, n], -1), position_embeddings=cos_sin,
                                  attention_mask=mask)
        x = x + attn
        x = x + first.mlp(first.post_attention_layernorm(x))
        for layer in self.layers[1:]:
            x = layer(x, attention_mask=mask, position_ids=positions,
                      position_embeddings=cos_sin)
        logits = self._rms(x[0, -1], w["norm.weight"]) @ w["lm_head.weight"].T
        return logits, x[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """k greedy drafts to follow `tokens` (the last one: the token just sampled)."""
        out = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        if self.version == 1:
            hidden = out.hidden_states[-1][0]
        else:
            streams = torch.cat([out.hidden_states[i][0] for i in self.aux_ids], -1)
            hidden = streams @ self.weights["fc.weight"].T
        ids = list(tokens[1:])
        drafts = []
        for _ in range(k):
            logits, carry = self._head(torch.tensor(ids), hidden)
            token = int(logits.argmax())
            if self.version == 3:
                token += int(self.weights["d2t"][token])
            drafts.append(token)
            ids.append(token)
            hidden = torch.cat([hidden, carry[-1:]], 0)
        return drafts


def record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the drafts proposed to follow them) at every proposal of the
    served EAGLE head in this process (rank 0's), appended as they happen."""
    seen: list[tuple[list[int], list[int]]] = []
    original = EagleDrafter.propose

    def propose(self, states, *args):
        drafts, passes, seconds = original(self, states, *args)
        by_id = {s.req_id: s for s in states}
        seen.extend((list(by_id[r].all_token_ids), d) for r, d in drafts.items())
        return drafts, passes, seconds

    monkeypatch.setattr(EagleDrafter, "propose", propose)
    return seen
