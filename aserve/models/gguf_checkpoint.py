"""A GGUF file's tensors as a checkpoint (`loader.load_weights` reads it like safetensors):
llama.cpp's tensor names mapped back to HF's, llama's Q / K rows un-permuted (llama.cpp stores
each head's rotary halves interleaved), Gemma's norms less the 1 llama.cpp added, every tensor
dequantized in torch
(`aserve/quantization/gguf_quants.py`). The file's header is `quantization.gguf_file`'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from aserve.quantization.gguf_file import GGUFMetadata
from aserve.quantization.gguf_quants import dequantize, has_int_form, int_weight
from aserve.quantization.int_weights import IntWeight

LAYER_TENSORS = {  # llama.cpp's name under blk.N. -> HF's under model.layers.N.
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
               "output": "lm_head"}
MOE_TENSORS = {  # a mixture of experts' router and shared expert (the experts: EXPERTS)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GEMMA_NORMS = {  # Gemma's four norms a layer (llama.cpp's ffn_norm is the one before the MLP)
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm"}


class GGUFCheckpoint:
    """A GGUF file's tensors as `loader.load_weights` reads a checkpoint: `keys()` (HF names),
    `get_tensor(name)` (float32, HF's layout), `get_slice(name)`."""

    def __init__(self, path: str | Path) -> None:
        self.meta = GGUFMetadata(path)
        arch = self.meta.arch
        heads = int(self.meta.arch_get("attention.head_count"))
        self.num_heads = {"q": heads,
                          "k": int(self.meta.arch_get("attention.head_count_kv", heads))}
        self.permuted = arch == "llama"  # llama.cpp permutes llama's Q / K rows, not qwen's
        self.gemma = arch.startswith("gemma")  # its norms stored as 1 + w (ggml scales by w)
        layer_tensors = {**LAYER_TENSORS, **MOE_TENSORS, **(GEMMA_NORMS if self.gemma else {})}
        self.names: dict[str, tuple[str, int | None]] = {}  # HF name -> (tensor, expert)
        for name, tensor in self.meta.tensors.items():
            if name == "rope_freqs.weight":
                continue  # (the config's llama3 rope_scaling, `GGUFMetadata._llama3_rope`)
            base, _, kind = name.rpartition(".")
            layer, _, part = base.removeprefix("blk.").partition(".")
            if part in EXPERTS:  # [experts, rows, cols]: one HF name per expert
                for e in range(int(tensor.shape[-1])):
                    self.names[f"model.layers.{layer}.mlp.experts.{e}.{EXPERTS[part]}.{kind}"] = (
                        name, e)
                continue
            hf = hf_name(name, layer_tensors)
            if hf is None:
                raise ValueError(f"{self.meta.path}: tensor {name!r} is not one aserve knows "
                                 f"for architecture {arch!r}.")
            self.names[hf] = (name, None)

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.names)

    def _raw(self, name: str) -> tuple[object, torch.Tensor, tuple[int, ...]]:
        """(the file's tensor, its bytes, HF's shape) of `name` (an expert's rows alone)."""
        source, expert = self.names[name]
        tensor = self.meta.tensors[source]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists innermost first
        data = tensor.data.reshape(-1).view("uint8")
        if expert is not None:  # only this expert's rows are read
            size = len(data) // shape[0]
            data, shape = data[expert * size:(expert + 1) * size], shape[1:]
        return tensor, torch.from_numpy(data.copy()), shape

    def _rope_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp permuted in `name`, or None."""
        if self.permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            return self.num_heads[name.split(".")[-2][0]]
        return None

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor, raw, shape = self._raw(name)
        value = dequantize(raw, tensor.tensor_type, shape, name=tensor.name)
        if name.endswith("shared_expert_gate.weight"):
            value = value.reshape(1, -1)  # (llama.cpp keeps it as a vector)
        heads = self._rope_heads(name)
        if heads is not None:
            value = unpermute_rope_rows(value, heads)
        if self.gemma and name.endswith("norm.weight"):
            value -= 1
        return value

    def int_weight_source(self, name: str) -> Callable[[], IntWeight | None] | None:
        """How to read `name`'s integer form (`gguf_quants.int_weight`, HF's row order) when a
        kernel packs it (an expert's rows alone); None for a tensor that has none (floats,
        vectors)."""
        source, expert = self.names[name]
        tensor = self.meta.tensors[source]
        if len(tensor.shape) != (2 if expert is None else 3) or not has_int_form(
                tensor.tensor_type):
            return None

        def read() -> IntWeight | None:
            tensor, raw, shape = self._raw(name)
            weight = int_weight(raw, tensor.tensor_type, shape, name=tensor.name)
            heads = self._rope_heads(name)
            if weight is not None and heads is not None:
                weight = weight.rows(unpermute_rope_rows(torch.arange(shape[0]), heads))
            return weight

        return read

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)


def hf_name(name: str, layer_tensors: dict[str, str] = LAYER_TENSORS) -> str | None:
    """HF's name of a llama.cpp tensor; None for one not known."""
    base, _, kind = name.rpartition(".")
    if base in TOP_TENSORS:
        return f"{TOP_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's row order of a llama Q / K weight that llama.cpp stored with each head's rotary
    halves interleaved (`convert_hf_to_gguf.py`'s permute, undone)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
