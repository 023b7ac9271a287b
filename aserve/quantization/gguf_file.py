"""GGUF files (llama.cpp's format) as aserve models: `--model file.gguf`, or a directory
holding one GGUF and no config.json. Torch-free (the engine's arguments call it).

    gguf_model_dir(path)   a directory the rest of aserve reads as an HF model directory:
                           config.json, generation_config.json, tokenizer.json and
                           tokenizer_config.json built from the file's metadata
                           (`gguf_tokenizer.py`), and a link to the file (`model.gguf`), in
                           aserve's cache (`ASERVE_CACHE`, default ~/.cache/aserve/gguf), keyed
                           by the file's path, size and mtime
    GGUFMetadata(path)     the file's header, checked (architecture, quant types)

Its tensors are read by `aserve/models/gguf_checkpoint.py` (HF's names, dequantized in torch by
`gguf_quants.py`).

The file is parsed with the `gguf` package (llama.cpp's own). Served: the architectures
`llama` (Llama, Mistral, SmolLM; with experts, Mixtral), `qwen2`, `qwen3`, `gemma2`, `gemma3`
(text), `qwen2moe` and `qwen3moe`; the
tokenizers `gpt2` (byte-level BPE, with llama.cpp's pre-tokenizer names) and `llama`
(SentencePiece BPE with byte fallback). Anything else (an architecture, a pre-tokenizer, a
quant type, a truncated or corrupt file) is one ValueError naming what and where, before a
weight is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}  # (llama with experts: Mixtral)
# whether an architecture's router renormalises its top-k weights, as llama.cpp runs it (a
# file's `expert_weights_norm` says otherwise)
MOE_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# Gemma's attention scale is 1/sqrt(query_pre_attn_scalar): head_dim, but hidden / heads in the
# 27B models, which llama.cpp tells by their layer count (GGUF has no key for it)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # every N-th layer is global (llama.cpp's)
LINK_NAME = "model.gguf"


def is_gguf(model: str | Path) -> bool:
    """Whether `model` names a GGUF file, or a directory holding one and no config.json."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.suffix == ".gguf" or _has_magic(path)
    return (path.is_dir() and not (path / "config.json").exists()
            and any(path.glob("*.gguf")))


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_file(model: str | Path) -> Path:
    path = Path(model).expanduser().resolve()
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"{path} holds {len(files)} GGUF files; name the one to serve "
                         f"({', '.join(f.name for f in files[:4])}).")
    return files[0]


def model_source(model: str | Path) -> str:
    """The file a GGUF model's directory stands for (what `/v1/models` names as its root);
    any other model as it is."""
    link = Path(model) / LINK_NAME
    return str(link.resolve()) if link.is_symlink() else str(model)


class GGUFError(ValueError):
    """A GGUF file aserve cannot serve (the CLI's exit 1: a bad model, not a bad command)."""


def gguf_model_dir(model: str | Path) -> Path:
    """The HF-shaped directory of a GGUF model (module docstring), made on first use;
    `GGUFError` naming what and where for one that cannot be served."""
    try:
        return _gguf_model_dir(model)
    except GGUFError:
        raise
    except ValueError as e:
        raise GGUFError(str(e)) from None


def _gguf_model_dir(model: str | Path) -> Path:
    path = gguf_file(model)
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    cache = Path(os.environ.get("ASERVE_CACHE", "~/.cache/aserve")).expanduser()
    out = cache / "gguf" / key[:24]
    if (out / "config.json").is_file():
        return out
    reader = GGUFMetadata(path)
    staging = out.with_name(out.name + f".{os.getpid()}.tmp")
    staging.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_config = reader.tokenizer()
    tokenizer.save(str(staging / "tokenizer.json"))
    files = {"config.json": reader.config(), "tokenizer_config.json": tokenizer_config,
             "generation_config.json": reader.generation_config()}
    for name, data in files.items():
        (staging / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    (staging / LINK_NAME).symlink_to(path)
    try:
        staging.rename(out)
    except OSError:  # another process made it first
        import shutil
        shutil.rmtree(staging, ignore_errors=True)
    return out


class GGUFMetadata:
    """A GGUF file's header: its metadata and tensor table, checked."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - numpy / struct errors of a bad file
            raise ValueError(f"{self.path} is not a readable GGUF file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from None
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {self.arch!r} is not served "
                             f"(served: {', '.join(sorted(ARCHITECTURES))}).")
        from aserve.quantization.gguf_quants import check_supported  # (torch: a GGUF's load)

        self.tensors = {t.name: t for t in self.reader.tensors}
        for tensor in self.reader.tensors:
            check_supported(tensor.tensor_type, f"{tensor.name} in {self.path.name}")

    def get(self, key: str, default: Any = KeyError) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}.")
            return default
        return field.contents()

    def arch_get(self, key: str, default: Any = KeyError) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    # ------------------------------------------------------------------------- config

    def config(self) -> dict[str, Any]:
        """config.json, as HF's for this architecture."""
        heads = int(self.arch_get("attention.head_count"))
        hidden = int(self.arch_get("embedding_length"))
        tokens = self.get("tokenizer.ggml.tokens")
        embed = self.tensors["token_embd.weight"]
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_get("feed_forward_length")),
            "num_hidden_layers": int(self.arch_get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_get("attention.head_count_kv", heads)),
            "head_dim": int(self.arch_get("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.arch_get("context_length")),
            "rms_norm_eps": float(self.arch_get("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.arch_get("rope.freq_base", 10000.0)),
            "vocab_size": int(embed.shape[1]) if len(embed.shape) > 1 else len(tokens),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "torch_dtype": "float32" if all(t.tensor_type.name == "F32"
                                            for t in self.reader.tensors) else "bfloat16",
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.get("tokenizer.ggml.eos_token_id", None),
            "gguf": {"file": str(self.path), "tensor_types": self.tensor_types()},
        }
        scaling = self.arch_get("rope.scaling.type", None)
        if "rope_freqs.weight" in self.tensors:
            config["rope_scaling"] = self._llama3_rope(config)
        elif scaling not in (None, "none"):
            if scaling not in ("linear", "yarn"):
                raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported.")
            config["rope_scaling"] = {"rope_type": scaling,
                                      "factor": float(self.arch_get("rope.scaling.factor"))}
            original = self.arch_get("rope.scaling.original_context_length", None)
            if original is not None:
                config["rope_scaling"]["original_max_position_embeddings"] = int(original)
        if self.arch_get("attention.sliding_window", None):
            config["sliding_window"] = int(self.arch_get("attention.sliding_window"))
        if self.arch.startswith("gemma"):
            config.update(self._gemma(config))
        if self.arch_get("expert_count", None):
            config.update(self._experts())
        return config

    def _experts(self) -> dict[str, Any]:
        """A mixture of experts' keys: every layer sparse (llama.cpp has no dense ones among
        them), the count and top-k, the experts' and the shared expert's widths."""
        count, top_k = int(self.arch_get("expert_count")), int(self.arch_get("expert_used_count"))
        renormalize = bool(self.arch_get("expert_weights_norm", MOE_RENORMALIZE[self.arch]))
        if self.arch == "llama":
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": count, "num_experts_per_tok": top_k}
        out = {"num_experts": count, "num_experts_per_tok": top_k, "norm_topk_prob": renormalize,
               "moe_intermediate_size": int(self.arch_get("expert_feed_forward_length")),
               "decoder_sparse_step": 1, "mlp_only_layers": []}
        shared = self.arch_get("expert_shared_feed_forward_length", None)
        if shared:
            out["shared_expert_intermediate_size"] = int(shared)
        return out

    def _llama3_rope(self, config: dict[str, Any]) -> dict[str, Any]:
        """HF's llama3 rope_scaling behind a `rope_freqs` tensor (llama.cpp stores the factor
        each frequency is divided by, not the parameters): the factor is the largest, and the
        factors between 1 and it, 1 / ((1 - s) / factor + s) with s = a / wavelength - b, give
        a = original / (high - low) and b = low / (high - low) by least squares; `original`
        is the file's `rope.scaling.original_context_length` (default 8192: any value gives
        the same frequencies). Checked by recomputing every factor."""
        import numpy as np

        factors = np.asarray(self.tensors["rope_freqs.weight"].data, dtype=np.float64)
        dim = 2 * len(factors)
        wavelength = 2 * np.pi * config["rope_theta"] ** (np.arange(0, dim, 2) / dim)
        factor = float(factors.max())
        original = int(self.arch_get("rope.scaling.original_context_length", 8192))
        medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
        if medium.sum() >= 2:
            smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
            a, minus_b = np.polyfit(1 / wavelength[medium], smooth, 1)
            low, high = -minus_b * original / a, (1 - minus_b) * original / a
        else:  # no curve to fit: boundaries between the last 1 and the first `factor`
            ones, full = wavelength[factors <= 1 + 1e-6], wavelength[factors >= factor * (1 - 1e-6)]
            high = original / (ones.max() * 1.001) if len(ones) else original / 1e-9
            low = original / (full.min() * 0.999) if len(full) else high / 2
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                  "high_freq_factor": float(high), "original_max_position_embeddings": original}
        smooth = np.clip((original / wavelength - low) / (high - low), 0, 1)
        expected = np.where(wavelength < original / high, 1.0, np.where(
            wavelength > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        if not np.allclose(expected, factors, rtol=1e-4):
            raise ValueError(f"{self.path}: rope_freqs.weight does not follow Llama 3's rope "
                             "scaling; such factors are not supported.")
        return params

    def _gemma(self, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma-2 / 3's keys: the attention scale, each layer's attention type (the file's
        `sliding_window_pattern`, a period or a bool per layer, else llama.cpp's default),
        soft-caps (Gemma-2), the sliding layers' rope base (Gemma-3: `rope.freq_base_swa`,
        default 10000, as llama.cpp's)."""
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        scalar = (config["hidden_size"] // heads if layers == GEMMA_27B_LAYERS[self.arch]
                  else config["head_dim"])
        pattern = self.arch_get("attention.sliding_window_pattern",
                                GEMMA_SLIDING_PATTERN[self.arch])
        sliding = ([(i + 1) % int(pattern) != 0 for i in range(layers)]
                   if isinstance(pattern, int) else [bool(p) for p in pattern])
        out: dict[str, Any] = {
            "model_type": "gemma3_text" if self.arch == "gemma3" else "gemma2",
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar, "tie_word_embeddings": True,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
        if self.arch == "gemma2":
            out["attn_logit_softcapping"] = self.arch_get("attn_logit_softcapping", None)
            out["final_logit_softcapping"] = self.arch_get("final_logit_softcapping", None)
        else:
            out["rope_local_base_freq"] = float(self.arch_get("rope.freq_base_swa", 10000.0))
        return out

    def tensor_types(self) -> dict[str, int]:
        """How many tensors the file holds of each quant type, most first."""
        counts: dict[str, int] = {}
        for tensor in self.reader.tensors:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def generation_config(self) -> dict[str, Any]:
        out = {k: self.get(f"tokenizer.ggml.{k}", None)
               for k in ("bos_token_id", "eos_token_id")}
        return {k: v for k, v in out.items() if v is not None}

    # ---------------------------------------------------------------------- tokenizer

    def tokenizer(self):
        """(tokenizers.Tokenizer, tokenizer_config.json) of the file's vocabulary."""
        from aserve.quantization.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self)

    @cached_property
    def token_list(self) -> list[str]:
        return list(self.get("tokenizer.ggml.tokens"))
