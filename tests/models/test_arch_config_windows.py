"""Each layer's attention type and window, as transformers 5.x derives them from config.json:
the same `layer_types` as the transformers config class builds (Mistral: every layer slides and
`layer_types` is ignored; Qwen2/3: only with `use_sliding_window`, from `max_window_layers` on,
or as `layer_types` lists; Llama: never), `sliding_window` 0 or null meaning none, and keys a
config omits taking transformers' defaults; unknown attention types are refused by name."""

from __future__ import annotations

import json

import pytest

from aserve.models import ModelArchConfig

FULL, SLIDING = "full_attention", "sliding_attention"


DROP = object()  # a `config` change: remove the key


def config(model_dir, **changes) -> dict:
    """The model's config.json with `changes`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not DROP}


def hf_windows(config_cls, **kwargs) -> tuple[int | None, ...]:
    """Per layer: the window transformers' attention module gets (None: full)."""
    hf = config_cls(**kwargs)
    types = getattr(hf, "layer_types", None) or [SLIDING] * hf.num_hidden_layers
    return tuple(hf.sliding_window if t == SLIDING else None for t in types)


@pytest.mark.parametrize("kwargs", [
    dict(use_sliding_window=True, sliding_window=13, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=13, max_window_layers=0),
    dict(use_sliding_window=False, sliding_window=13, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=13, layer_types=[SLIDING, FULL, SLIDING, FULL]),
    dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),
])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_windows_match_transformers(arch, kwargs, qwen2_dir, qwen3_dir):
    import transformers

    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    model_dir = {"qwen2": qwen2_dir, "qwen3": qwen3_dir}[arch]
    cfg = config(model_dir, num_hidden_layers=4, **{"layer_types": DROP, **kwargs})
    assert ModelArchConfig.from_hf(cfg).layer_windows == hf_windows(
        config_cls, num_hidden_layers=4, **kwargs)


def test_qwen_config_without_window_keys_takes_transformers_defaults(qwen2_dir):
    cfg = config(qwen2_dir, num_hidden_layers=30, layer_types=DROP, sliding_window=DROP,
                 max_window_layers=DROP, use_sliding_window=True)
    windows = ModelArchConfig.from_hf(cfg).layer_windows  # window 4096 from layer 28 on
    assert windows == (None,) * 28 + (4096, 4096)


def test_mistral_slides_every_layer_whatever_layer_types_say(mistral_dir):
    cfg = config(mistral_dir, sliding_window=7, layer_types=[FULL, SLIDING])
    arch = ModelArchConfig.from_hf(cfg)
    assert arch.layer_windows == (7, 7) and arch.layer_types == (SLIDING, SLIDING)
    assert ModelArchConfig.from_hf(config(mistral_dir, sliding_window=DROP)).sliding_window == 4096


@pytest.mark.parametrize("window", [0, None])
def test_zero_or_null_window_means_full_attention(mistral_dir, window):
    arch = ModelArchConfig.from_hf(config(mistral_dir, sliding_window=window))
    assert arch.sliding_window is None and arch.layer_windows == (None, None)
    assert arch.layer_types == (FULL, FULL)


def test_llama_never_slides(llama_dir):
    arch = ModelArchConfig.from_hf(config(llama_dir, sliding_window=8, layer_types=[SLIDING] * 2))
    assert arch.layer_windows == (None, None)


def test_an_unknown_attention_type_is_refused_by_name(qwen2_dir):
    cfg = config(qwen2_dir, use_sliding_window=True, sliding_window=8,
                 layer_types=["chunked_attention", FULL])
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelArchConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        ModelArchConfig.from_hf(config(qwen2_dir, layer_types=[FULL] * 3))
