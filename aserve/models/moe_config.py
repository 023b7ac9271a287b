"""`moe_config`: a mixture-of-experts model's routing and expert shapes
(`aserve.config.MoEConfig`), read from its HF config for `ModelArchConfig`, and like it the only
place that reads these raw keys.

    family      experts key         routing                            sparse layers
    Mixtral     num_local_experts   softmax, top-k, renormalised       every layer
    Qwen2-MoE   num_experts         softmax, top-k, [norm_topk_prob];  (i+1) % decoder_sparse_step
                                    + a sigmoid-gated shared expert    == 0, not mlp_only_layers
    Qwen3-MoE   num_experts         softmax, top-k, [norm_topk_prob]   as Qwen2-MoE
    gpt-oss     num_local_experts   top-k of biased logits, softmax;   every layer
                                    biased experts, clamped SwiGLU

The expert count may come under any of `num_local_experts`, `num_experts` or
`n_routed_experts`. What aserve cannot route (DeepSeek's grouped top-k, sigmoid scoring, a
routed scaling factor, a top-k method but greedy) is refused naming the key.
"""

from __future__ import annotations

from typing import Any

from aserve.config import MoEConfig

_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# transformers' default expert counts, for a config.json that names none
_DEFAULT_NUM_EXPERTS = {"MixtralForCausalLM": 8, "Qwen2MoeForCausalLM": 60,
                        "Qwen3MoeForCausalLM": 128, "GptOssForCausalLM": 128}
_MOE_ARCHS = tuple(_DEFAULT_NUM_EXPERTS)


def moe_config(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    """The MoE part of a (text) config, None for a dense model."""
    if arch not in _MOE_ARCHS:
        return None
    _refuse_unsupported_routing(arch, cfg)
    num_experts = next((cfg[k] for k in _EXPERT_COUNT_KEYS if cfg.get(k)),
                       _DEFAULT_NUM_EXPERTS[arch])
    top_k = cfg.get("num_experts_per_tok") or 2
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the "
                         f"{num_experts} experts.")
    num_layers = cfg["num_hidden_layers"]
    if arch == "GptOssForCausalLM":
        return MoEConfig(num_experts, top_k, cfg["intermediate_size"], (True,) * num_layers,
                         scoring="topk_softmax", activation="swiglu_oai",
                         swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                         swiglu_limit=cfg.get("swiglu_limit", 7.0), expert_bias=True,
                         router_bias=True, interleaved_gate_up=True)
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts, top_k, cfg["intermediate_size"], (True,) * num_layers,
                         renormalize=True)
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = (cfg.get("shared_expert_intermediate_size") or 0
              if arch == "Qwen2MoeForCausalLM" else 0)
    return MoEConfig(num_experts, top_k, cfg["moe_intermediate_size"], sparse,
                     renormalize=bool(cfg.get("norm_topk_prob", False)), round_weights=True,
                     shared_expert_intermediate_size=shared)


def _refuse_unsupported_routing(arch: str, cfg: dict[str, Any]) -> None:
    """Routing features of other MoE families that would change the result if ignored."""
    if (cfg.get("n_group") or 1) > 1 or (cfg.get("topk_group") or 1) > 1:
        raise ValueError(f"{arch} config asks for grouped top-k routing (n_group / "
                         "topk_group), which aserve does not implement.")
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"{arch} config asks for {cfg['scoring_func']!r} expert scoring; "
                         "aserve routes with softmax only.")
    if float(cfg.get("routed_scaling_factor") or 1.0) != 1.0:
        raise ValueError(f"{arch} config has routed_scaling_factor "
                         f"{cfg['routed_scaling_factor']}, which aserve does not apply.")
    if cfg.get("topk_method") not in (None, "greedy"):
        raise ValueError(f"{arch} config asks for top-k method {cfg['topk_method']!r}; aserve "
                         "implements greedy top-k only.")
