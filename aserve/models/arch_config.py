"""`ModelArchConfig`: the HF `config.json` (+ `generation_config.json`) normalised once.

Everything model code needs is read here, with each family's HF defaults applied, so no other
module looks at raw HF keys: rope parameters in either the transformers-5 form
(`rope_parameters` with `rope_type` and `rope_theta`) or the older one (`rope_scaling` with
`type` / `rope_type` and a top-level `rope_theta`), explicit or derived `head_dim`, per-family
biases (Qwen2: q/k/v biased, o_proj not), Qwen3's q/k norms and sliding windows (Mistral's
`sliding_window`; Qwen2/3's only with `use_sliding_window` and a layer that slides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

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
        cfg = hf_config
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no `architectures` entry.")
        arch = archs[0]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu).")
        num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        default_head_dim = 128 if arch == "Qwen3ForCausalLM" else hidden // num_heads
        head_dim = cfg.get("head_dim") or default_head_dim
        max_pos = cfg.get("max_position_embeddings", 2048)
        theta, scaling, partial = _rope(cfg, max_pos)
        qkv_bias, o_bias = _attention_biases(arch, cfg)
        window, layer_types = _layer_types(arch, cfg)
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rotary_dim=int(head_dim * partial), max_position_embeddings=max_pos,
            rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias, o_proj_bias=o_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window, layer_types=layer_types,
            dtype=_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype"))),
            eos_token_ids=_eos_ids(cfg, generation_config or {}),
            bos_token_id=(generation_config or {}).get("bos_token_id", cfg.get("bos_token_id")))


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
    bias = bool(cfg.get("attention_bias", False))
    return bias, bias


_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding window, each layer's attention type), as HF reads them.

    `sliding_window` 0 or null means none. Llama never slides; Mistral slides every layer;
    Qwen2/3 only with `use_sliding_window`, from `max_window_layers` on (or as `layer_types`
    says). Any attention type but full and sliding is refused, naming it.
    """
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or None
    types = cfg.get("layer_types")
    if arch == "LlamaForCausalLM":
        window = None
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            window = None
        if types is None:
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= first
                     else "full_attention" for i in range(num_layers)]
    elif types is None:  # Mistral: one window for every layer
        types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
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


def _eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    eos = generation_config.get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
