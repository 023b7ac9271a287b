"""`ModelArchConfig`: the HF `config.json` (+ `generation_config.json`) normalised once.

Everything model code needs is read here, with each family's HF defaults applied, so no other
module looks at raw HF keys: rope parameters in either the transformers-5 form
(`rope_parameters` with `rope_type` and `rope_theta`) or the older one (`rope_scaling` with
`type` / `rope_type` and a top-level `rope_theta`), explicit or derived `head_dim`, per-family
biases (Qwen2: q/k/v biased, o_proj not), Qwen3's and Gemma-3's q/k norms, and each layer's
attention type and window (Mistral: every layer slides; Qwen2/3 only with `use_sliding_window`,
from `max_window_layers` on; Gemma-2 and gpt-oss every other layer; Gemma-3 all but every
`sliding_window_pattern`-th; `layer_types` where the config lists them), a mixture of experts'
routing (`moe_config.py`) and gpt-oss' attention sinks.

Gemma-2/3 also bring their attention scale (`query_pre_attn_scalar`), soft-caps and, for
Gemma-3, the sliding layers' own rope (`rope_local_base_freq`, or the transformers-5 nested
`rope_parameters`). A `Gemma3ForConditionalGeneration` config is read through its `text_config`
(the vision tower is not served). Keys a family's config.json may omit take transformers'
defaults for that family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from aserve.config import BARE_DECODERS, MoEConfig
from aserve.models.moe_config import moe_config
from aserve.quantization.hf_checkpoint import check_quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCALED_ROPE_WITH_ORIGINAL_LEN = ("llama3", "yarn")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # the first of config.json's `architectures`
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # head_dim * partial_rotary_factor
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # None: plain rope
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before rope
    sliding_window: int | None = None  # the window of the layers that slide
    # Per layer: "full_attention" or "sliding_attention" (HF's `layer_types`); () all full.
    layer_types: tuple[str, ...] = ()
    dtype: torch.dtype | None = None  # the checkpoint's dtype, if config.json names one
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5
    attn_logit_softcapping: float | None = None  # attention scores: cap * tanh(s / cap)
    final_logit_softcapping: float | None = None  # logits: cap * tanh(logits / cap)
    # Gemma-3: the sliding layers' rope (None: every layer uses rope_theta / rope_scaling).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    moe: MoEConfig | None = None  # a mixture of experts: its routing and which layers are sparse
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per query head

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window, or None for full attention."""
        if not self.layer_types:
            return (None,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.layer_types)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any],
                generation_config: dict[str, Any] | None = None) -> ModelArchConfig:
        """Normalise a parsed config.json (and optionally generation_config.json)."""
        archs = hf_config.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no `architectures` entry.")
        arch = BARE_DECODERS.get(archs[0], archs[0])  # a bare decoder: its causal LM's stack
        cfg = {**_FAMILY_DEFAULTS.get(arch, {}), **_text_config(hf_config)}
        act = _hidden_act(arch, cfg)
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{arch} with use_bidirectional_attention is not supported "
                             "(aserve serves causal decoders only).")
        num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        default_head_dim = 128 if arch == "Qwen3ForCausalLM" else hidden // num_heads
        head_dim = cfg.get("head_dim") or default_head_dim
        max_pos = cfg.get("max_position_embeddings", 2048)
        (theta, scaling, partial), local = _rope_by_layer_type(arch, cfg, max_pos)
        qkv_bias, o_bias = _attention_biases(arch, cfg)
        window, layer_types = _layer_types(arch, cfg)
        is_gemma = arch in _GEMMA_ARCHS
        _refuse_quantization(arch, hf_config)
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rotary_dim=int(head_dim * partial), max_position_embeddings=max_pos,
            rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias, o_proj_bias=o_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_GEMMA3_ARCHS),
            sliding_window=window, layer_types=layer_types,
            dtype=_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype"))),
            eos_token_ids=_eos_ids(cfg, generation_config or {}),
            bos_token_id=(generation_config or {}).get("bos_token_id", cfg.get("bos_token_id")),
            hidden_act=act,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if is_gemma else None,
            # HF's Gemma-3 attention takes no soft-cap (nor does vLLM's): only Gemma-2 applies it
            attn_logit_softcapping=(cfg.get("attn_logit_softcapping") or None
                                    if arch == "Gemma2ForCausalLM" else None),
            final_logit_softcapping=(cfg.get("final_logit_softcapping") or None
                                     if is_gemma else None),
            local_rope_theta=None if local is None else local[0],
            local_rope_scaling=None if local is None else local[1],
            moe=moe_config(arch, cfg), attention_sinks=arch == "GptOssForCausalLM")


_GEMMA3_ARCHS = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_GEMMA_ARCHS = ("Gemma2ForCausalLM", *_GEMMA3_ARCHS)
_GEMMA_DEFAULTS = dict(  # keys shared by transformers' Gemma2Config and Gemma3TextConfig
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1)
_GEMMA3_DEFAULTS = dict(
    _GEMMA_DEFAULTS, vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
    num_hidden_layers=26, max_position_embeddings=131_072)
# transformers' defaults for keys a config.json may omit (the rest are required, or read with
# the defaults below them)
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "MistralForCausalLM": {"sliding_window": 4096},
    "MixtralForCausalLM": {"num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "Qwen2MoeForCausalLM": {"num_experts_per_tok": 4,
                            "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632, "sliding_window": 4096,
                            "qkv_bias": True},
    "GptOssForCausalLM": {"num_experts_per_tok": 4, "sliding_window": 128, "head_dim": 64,
                          "attention_bias": True, "rms_norm_eps": 1e-5},
    "Qwen3MoeForCausalLM": {"num_experts_per_tok": 8,
                            "moe_intermediate_size": 768, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"sliding_window": 4096},
    "Qwen3ForCausalLM": {"sliding_window": 4096},
    "Gemma2ForCausalLM": dict(
        _GEMMA_DEFAULTS, vocab_size=256_000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, max_position_embeddings=8192, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0),
    "Gemma3ForCausalLM": _GEMMA3_DEFAULTS,
    "Gemma3ForConditionalGeneration": _GEMMA3_DEFAULTS,
}
# Top-level keys of a multimodal config that hold for its text model too
_TOP_LEVEL_KEYS = ("architectures", "eos_token_id", "bos_token_id", "pad_token_id", "dtype",
                   "torch_dtype", "tie_word_embeddings")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: a multimodal config's `text_config` with the top-level keys
    that apply to it; any other config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    return {**text, **{k: cfg[k] for k in _TOP_LEVEL_KEYS if k in cfg}}


_GATE_ACTS = {"silu": ("silu",), "gemma": ("gelu_pytorch_tanh",)}


def _hidden_act(arch: str, cfg: dict[str, Any]) -> str:
    """The MLP's gate activation; HF Gemma reads `hidden_activation` (`hidden_act` before)."""
    if arch in _GEMMA_ARCHS:
        act, supported = (cfg.get("hidden_activation") or cfg.get("hidden_act")
                          or "gelu_pytorch_tanh"), _GATE_ACTS["gemma"]
    else:
        act, supported = cfg.get("hidden_act") or "silu", _GATE_ACTS["silu"]
    if act not in supported:
        raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only "
                         f"{', '.join(supported)}).")
    return act


def _rope_by_layer_type(arch: str, cfg: dict[str, Any], max_pos: int
                        ) -> tuple[tuple[float, dict[str, Any] | None, float],
                                   tuple[float, dict[str, Any] | None] | None]:
    """(the full layers' `_rope`, the sliding layers' (theta, scaling) or None: the same).

    Gemma-3 gives each layer type its rope: transformers 5 nests them as
    `rope_parameters[layer_type]`; older configs have `rope_theta` (default 1e6) and
    `rope_scaling` for full layers, `rope_local_base_freq` (default 1e4) for sliding ones.
    """
    if arch not in _GEMMA3_ARCHS:
        return _rope(cfg, max_pos), None
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_parameters": params.get("full_attention") or {}}
        local = {"rope_parameters": params.get("sliding_attention") or {}}
    else:
        full = {"rope_scaling": cfg.get("rope_scaling") or params}
        local = {}
    full["rope_theta"] = cfg.get("rope_theta") or 1_000_000.0  # where the nested dict has none
    local["rope_theta"] = cfg.get("rope_local_base_freq") or 10_000.0
    theta, scaling, _ = _rope(local, max_pos)
    return _rope(full, max_pos), (theta, scaling)


def _rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling params or None for plain rope, partial_rotary_factor)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if rope_type == "default":
        return theta, None, partial
    if rope_type in _SCALED_ROPE_WITH_ORIGINAL_LEN:
        if "original_max_position_embeddings" in cfg:  # top-level value wins, as in HF
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_pos)
    return theta, {"rope_type": rope_type, **params}, partial


def _attention_biases(arch: str, cfg: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias). HF Qwen2 hard-codes biased q/k/v and an unbiased o_proj."""
    if arch == "Qwen2ForCausalLM":
        return True, False
    if arch == "Qwen2MoeForCausalLM":  # its own key, o_proj never biased
        return bool(cfg.get("qkv_bias")), False
    bias = bool(cfg.get("attention_bias", False))
    return bias, bias


_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


_WINDOW_OPT_IN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                  "Qwen3MoeForCausalLM")  # slide only with `use_sliding_window`
_EVERY_LAYER_SLIDES = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")


def _layer_types(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding window, each layer's attention type), as transformers 5 reads them.

    `sliding_window` 0 or null means none. Llama never slides; Mistral, Mixtral and Qwen3-MoE
    slide every layer (their HF attention ignores `layer_types`); the Qwen families only with
    `use_sliding_window`: Qwen2/3 from `max_window_layers` on, Qwen2-MoE its even layers below
    it; Gemma-2 and gpt-oss their even layers; Gemma-3 all but every
    `sliding_window_pattern`-th — each unless `layer_types` says otherwise. Any attention type
    but full and sliding is refused, naming it.
    """
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or None
    if arch == "LlamaForCausalLM" or (arch in _WINDOW_OPT_IN
                                      and not cfg.get("use_sliding_window", False)):
        window = None
    types = None if arch in _EVERY_LAYER_SLIDES else cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window is not None and _slides_by_default(arch, cfg, i)
                 else "full_attention" for i in range(num_layers)]
    types = tuple(types or ["full_attention"] * num_layers)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers.")
    unsupported = sorted(set(types) - set(_SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"attention type(s) {', '.join(unsupported)} of layer_types are not "
                         f"supported (only {' and '.join(_SUPPORTED_LAYER_TYPES)}).")
    if window is None:  # sliding layers without a window attend to everything
        types = ("full_attention",) * num_layers
    return window, types


def _slides_by_default(arch: str, cfg: dict[str, Any], layer: int) -> bool:
    """Whether `layer` slides in a config without `layer_types` (and with a window)."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return layer >= cfg.get("max_window_layers", 28)
    if arch == "Qwen2MoeForCausalLM":
        return layer % 2 == 0 and layer < cfg.get("max_window_layers", 28)
    if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        return layer % 2 == 0
    if arch in _GEMMA3_ARCHS:
        return (layer + 1) % (cfg.get("sliding_window_pattern") or 6) != 0
    return True  # Mistral, Mixtral, Qwen3-MoE: every layer


def _refuse_quantization(arch: str, hf_config: dict[str, Any]) -> None:
    """A quantized checkpoint whose method aserve cannot dequantize at load
    (`quantization.hf_checkpoint.check_quantization`: gpt-oss' MXFP4 experts, bitsandbytes,
    an unknown method...) is refused, naming it."""
    quant = hf_config.get("quantization_config")
    if quant:
        try:
            check_quantization(quant)
        except ValueError as e:
            raise ValueError(f"{arch} checkpoint: {e}") from None


def _eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    eos = generation_config.get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
