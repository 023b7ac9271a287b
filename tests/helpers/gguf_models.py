"""Tiny GGUF files, written from the tiny HF models of `hf_models.py` the way llama.cpp's
`convert_hf_to_gguf.py` writes them: llama.cpp's metadata keys and tensor names, the Q/K rows
of llama / mistral permuted for its rotary layout, Gemma's norm weights stored as 1 + w, 1-D
tensors in F32 and the 2-D ones in the quant type asked for (`gguf.quants.quantize`; for the
K-quants it cannot make, random blocks with small scales, `random_blocks`), and the
tokenizer as a byte-level BPE vocabulary ("gpt2") with its merges and token types.

    write_gguf(hf_dir, path, "Q8_0")

The reference a test compares with is transformers reading the same file
(`from_pretrained(dir, gguf_file=...)`), which dequantizes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

LAYER_NAMES = {  # HF module (under model.layers.N.) -> llama.cpp tensor (under blk.N.)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
PLAIN_NORM = {"post_attention_layernorm": "ffn_norm"}  # llama, mistral, qwen
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
MOE_NAMES = {  # HF module under model.layers.N. -> llama.cpp tensor under blk.N.
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
               "w2": "down"}
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
         "Qwen3MoeForCausalLM": "qwen3moe"}
TOKEN_TYPES = {"normal": 1, "control": 3, "user_defined": 4}


def gguf_source(hf_name: str, gemma: bool) -> tuple[str, int | None]:
    """(llama.cpp's tensor, the expert's index in it or None) of an HF checkpoint name."""
    expert = EXPERT.match(hf_name)
    if expert:
        layer, index, proj = expert.groups()
        return f"blk.{layer}.ffn_{EXPERT_KIND[proj]}_exps.weight", int(index)
    return gguf_name(hf_name, gemma), None


def gguf_name(hf_name: str, gemma: bool) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    names = {**LAYER_NAMES, **MOE_NAMES, **(GEMMA_NORMS if gemma else PLAIN_NORM)}
    return f"blk.{layer}.{names[module]}.{kind}"


def permute_for_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's row order for llama's Q / K (its rotary pairs are adjacent, HF's halves)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(hf_dir: str | Path, path: str | Path, qtype: str = "F32") -> Path:
    import gguf

    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    gemma = arch.startswith("gemma")
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch != "gemma3" or "full_attention" not in (config.get("rope_parameters") or {}):
        writer.add_rope_freq_base(float(config.get("rope_theta") or (
            config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if gemma and config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
    if gemma and config.get("layer_types"):
        writer.add_sliding_window_pattern([t == "sliding_attention"
                                           for t in config["layer_types"]])
    rope = config.get("rope_parameters") or {}
    if arch == "gemma3" and "full_attention" in rope:  # transformers 5's rope per layer type
        writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        if rope["full_attention"].get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp keeps the factors, not the parameters
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(
            rope, float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            head_dim))
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(
                int(config["shared_expert_intermediate_size"]))
    write_tokenizer(writer, hf_dir)
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    tensors = stack_experts(load_file(str(hf_dir / "model.safetensors")), gemma)
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = permute_for_rope(value, heads if "q_proj" in name else kv_heads)
        if gemma and name.endswith("norm.weight"):
            value = value + 1  # ggml's RMS norm scales by w, Gemma's by 1 + w
        target = name if name.startswith("blk.") else gguf_name(name, gemma)
        if value.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, value)
        elif qt == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(target, value.astype(np.float16))
        elif qtype in SCALE_OFFSETS:  # K-quants gguf cannot quantize: random valid blocks
            rows = random_blocks((int(np.prod(value.shape[:-1])), value.shape[-1]), qt, rng)
            writer.add_tensor(target, rows.reshape(*value.shape[:-1], -1), raw_dtype=qt)
        else:
            data = gguf.quants.quantize(value, qt)
            writer.add_tensor(target, data, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stack_experts(tensors: dict[str, np.ndarray], gemma: bool) -> dict[str, np.ndarray]:
    """Per-expert weights as llama.cpp keeps them: one [experts, rows, cols] tensor per layer and
    kind (`blk.N.ffn_gate_exps.weight`); the rest as they are."""
    out, stacks = {}, {}
    for name, value in tensors.items():
        source, index = gguf_source(name, gemma)
        if index is None:
            out[name] = value
        else:
            stacks.setdefault(source, {})[index] = value
    for source, parts in stacks.items():
        out[source] = np.stack([parts[i] for i in range(len(parts))])
    return out


# Where each K-quant block keeps its float16 super-block scales (d, then dmin where it has
# one), as llama.cpp's ggml-common.h lays the blocks out; the rest of a block is small ints.
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}


def random_blocks(shape: tuple[int, ...], qt, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant whose weights stay small: random bytes, with every
    super-block scale set to a small float16 (`gguf` quantizes no K-quant itself)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qt.name]:
        scale = rng.uniform(2e-4, 6e-4, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def write_spm_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """A SentencePiece-style tokenizer as HF's Llama / Mistral tokenizer.json has it: BPE with
    byte fallback (`<0x00>`..`<0xFF>` in the vocabulary), "▁" for spaces with one prepended
    to the text, `<s>` added in front; written over `out_dir`'s tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from helpers.hf_models import corpus

    out = Path(out_dir)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPM_SPECIALS + BYTE_TOKENS,
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    saved = json.loads((out / "tokenizer.json").read_text())  # bytes: vocabulary, not added
    saved["added_tokens"] = [t for t in saved["added_tokens"] if t["content"] in SPM_SPECIALS]
    (out / "tokenizer.json").write_text(json.dumps(saved))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "clean_up_tokenization_spaces": False, "added_tokens_decoder": {
                  str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                           "rstrip": False, "single_word": False}
                  for i, t in enumerate(SPM_SPECIALS)}}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def write_spm_vocab(writer, tok: dict, tok_config: dict) -> None:
    """llama.cpp's SentencePiece vocabulary: tokens, scores (a merged piece scores minus its
    merge's rank), types (unknown 2, control 3, byte 6)."""
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    rank = {m.replace(" ", ""): i for i, m in reversed(list(enumerate(merges)))}
    kinds = {"<unk>": 2, "<s>": 3, "</s>": 3, **{b: 6 for b in BYTE_TOKENS}}
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(rank.get(t, 1e6 + vocab[t])) for t in tokens])
    writer.add_token_types([kinds.get(t, 1) for t in tokens])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_add_bos_token(True)
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def write_tokenizer(writer, hf_dir: Path) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    if tok["model"].get("byte_fallback"):
        return write_spm_vocab(writer, tok, tok_config)
    vocab = dict(tok["model"]["vocab"])
    kinds = {}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = "control" if added["special"] else "user_defined"
    tokens = [None] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_TYPES[kinds.get(i, "normal")] for i in range(len(tokens))])
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if tok_config.get(key):
            add(vocab[tok_config[key]])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def llama3_rope_factors(rope: dict, base: float, dim: int) -> np.ndarray:
    """What each rotary frequency is divided by under Llama 3's rope scaling, as llama.cpp's
    converter stores it (`rope_freqs.weight`)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelength = 2 * np.pi * base ** (i / dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def unpermute_for_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_reference(hf_dir: str | Path, gguf_path: str | Path):
    """The HF transformers model of `hf_dir`'s config.json (float32) holding the GGUF file's
    weights as llama.cpp's own package dequantizes them (`gguf.quants.dequantize`): what a
    float reference path must match token for token. (A checkpoint of those weights under the
    names `hf_dir`'s has, which transformers loads; for a directory without weights, the
    model's own parameter names.)"""
    import tempfile

    import gguf
    import torch
    import transformers
    from safetensors.torch import save_file

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    gemma = arch.startswith("gemma")
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    weights = hf_dir / "model.safetensors"
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    shapes = ({k: tuple(v.shape) for k, v in load_file(str(weights)).items()}
              if weights.is_file() else {k: tuple(v.shape) for k, v in model.state_dict().items()})
    state = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        source, expert = gguf_source(name, gemma)
        tensor = tensors[source]
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        value = (value.reshape(-1, *shape)[expert] if expert is not None
                 else value.reshape(shape))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            value = unpermute_for_rope(value, heads)
        if gemma and name.endswith("norm.weight"):
            value = value - 1
        state[name] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    if not weights.is_file():
        model.load_state_dict(state, strict=False)
        return model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(state, str(Path(tmp) / "model.safetensors"))
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32).eval()
