"""Gemma-2 and Gemma-3 loaded by `load_model` give HF transformers' logits (prefill through the
paged cache, then decodes past the sliding window), also from a Gemma3ForConditionalGeneration
checkpoint in either naming of its text tower; bfloat16 (embedding scale and Gemma's norms
rounded as HF rounds them) runs close to HF's bfloat16; the config is read as transformers
reads it: layer types from the older patterns, Gemma-3's rope per layer type in either form,
the multimodal `text_config`, and what is refused names itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.hf_models import SLIDING_CASES
from helpers.model_steps import bind_cache, hf_logits, load, prompt, step
from safetensors.torch import load_file, save_file

from aserve.models import ModelArchConfig
from aserve.models.gemma import GemmaForCausalLM

BLOCKS = [9, 3, 17, 0, 25, 4, 11, 30, 7, 21]  # shuffled, non-contiguous: 40 tokens


def read_config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def logits_through_cache(model_dir, ids, num_decodes=4):
    """Prefill all but the last `num_decodes` tokens, then decode them one by one."""
    model, arch = load(model_dir)
    bind_cache(model, arch)
    n = len(ids) - num_decodes
    out = [step(model, [(ids[:n], n, BLOCKS)])]
    out += [step(model, [(ids[:i + 1], 1, BLOCKS)]) for i in range(n, len(ids))]
    return torch.cat(out)  # [len(ids), vocab]


@pytest.mark.parametrize("fixture", ["gemma2_dir", "gemma3_dir", "gemma3_mm_dir"])
def test_prefill_and_decode_logits_match_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    ids = prompt(30)  # longer than the windows (10, 8)
    got = logits_through_cache(model_dir, ids)
    torch.testing.assert_close(got, hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4)


def test_each_layer_gets_its_window_scale_and_caps(gemma2_dir, gemma3_dir):
    model, arch = load(gemma2_dir)
    assert isinstance(model, GemmaForCausalLM)
    attn = model.attention_layers()
    assert [a.sliding_window for a in attn] == [10, None] == list(arch.layer_windows)
    assert all(a.soft_cap == 5.0 and a.scale == 24**-0.5 for a in attn)
    assert arch.final_logit_softcapping == 3.0 and arch.tie_word_embeddings
    model, arch = load(gemma3_dir)
    assert [a.sliding_window for a in model.attention_layers()] == [8, 8, None]
    layers = model.model.layers
    assert layers[0].self_attn.rotary_emb is layers[1].self_attn.rotary_emb
    assert layers[2].self_attn.rotary_emb is model.model.rotary_emb  # full: base 1e6, linear 8
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert arch.local_rope_theta == 1e4 and arch.local_rope_scaling is None


def test_conditional_generation_text_tower_loads_in_either_naming(gemma3_mm_dir, tmp_path):
    """transformers 5 writes `language_model.model.*`; it names them `model.language_model.*`
    in memory (and so may a checkpoint); the vision tower and projector are skipped."""
    ids = prompt(30)
    want = hf_logits(gemma3_mm_dir, ids)
    model_dir = shutil.copytree(gemma3_mm_dir, tmp_path / "model")
    weights = load_file(model_dir / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in weights)
    assert any("vision_tower" in k for k in weights)
    renamed = {k.replace("language_model.model.", "model.language_model.")
               .replace("vision_tower.", "model.vision_tower."): v for k, v in weights.items()}
    save_file(renamed, model_dir / "model.safetensors")
    torch.testing.assert_close(logits_through_cache(model_dir, ids), want, atol=1e-4, rtol=1e-4)


def test_gemma3_attention_soft_cap_is_ignored_as_hf_does(model_dir_factory):
    """HF's (and vLLM's) Gemma-3 attention takes no soft-cap, whatever the config says."""
    model_dir = model_dir_factory("gemma3", sliding_window=8, attn_logit_softcapping=0.5)
    ids = prompt(20)
    got = logits_through_cache(model_dir, ids)
    torch.testing.assert_close(got, hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4)


def test_bfloat16_is_close_to_hf_bfloat16(model_dir_factory):
    """The embedding scale is rounded to bf16 (sqrt(64) = 8 exactly, so the hidden size is
    widened to 72 here: sqrt(72) = 8.485 -> 8.5) and Gemma's norms round after their scale,
    as HF does; the bf16 difference from the float32 truth is no larger than HF's own."""
    model_dir = model_dir_factory("gemma3", **{**SLIDING_CASES["gemma3"][1], "hidden_size": 72})
    ids = prompt()
    model, arch = load(model_dir, dtype="bfloat16")
    assert model.model.embed_tokens.embed_scale.item() == 8.5
    bind_cache(model, arch, dtype=torch.bfloat16)
    got = torch.cat([step(model, [(ids[:-1], 20, BLOCKS)]), step(model, [(ids, 1, BLOCKS)])])
    ref = hf_logits(model_dir, ids, dtype=torch.bfloat16)
    torch.testing.assert_close(got, ref, atol=0.15, rtol=0.02)
    truth = hf_logits(model_dir, ids)
    ours, hf = (got - truth).abs().mean(), (ref - truth).abs().mean()
    assert ours <= 1.1 * hf, (ours, hf)


def test_layer_types_follow_the_older_patterns(gemma2_dir, gemma3_dir):
    """Without `layer_types`: Gemma-2 slides its even layers; Gemma-3 layer i slides iff
    (i + 1) % sliding_window_pattern != 0 (default 6) — as transformers derives them."""
    from transformers import Gemma2Config, Gemma3TextConfig

    cfg = {k: v for k, v in read_config(gemma2_dir).items() if k != "layer_types"}
    cfg["num_hidden_layers"] = 5
    assert ModelArchConfig.from_hf(cfg).layer_types == tuple(
        Gemma2Config(num_hidden_layers=5).layer_types)
    cfg = {k: v for k, v in read_config(gemma3_dir).items() if k != "layer_types"}
    for pattern in (None, 3):
        cfg.update(num_hidden_layers=7, sliding_window_pattern=pattern)
        hf = Gemma3TextConfig(num_hidden_layers=7, **({} if pattern is None else
                                                      {"sliding_window_pattern": pattern}))
        arch = ModelArchConfig.from_hf(cfg)
        assert arch.layer_types == tuple(hf.layer_types)
        assert arch.layer_windows == tuple(8 if t == "sliding_attention" else None
                                           for t in hf.layer_types)


def test_gemma3_legacy_rope_keys_read_like_nested_rope_parameters(gemma3_dir):
    nested = read_config(gemma3_dir)
    legacy = {k: v for k, v in nested.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    a, b = ModelArchConfig.from_hf(nested), ModelArchConfig.from_hf(legacy)
    assert (a.rope_theta, a.rope_scaling, a.local_rope_theta, a.local_rope_scaling) == (
        b.rope_theta, b.rope_scaling, b.local_rope_theta, b.local_rope_scaling)
    bare = {k: v for k, v in legacy.items()
            if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    c = ModelArchConfig.from_hf(bare)  # transformers' Gemma-3 defaults
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (1e6, None, 1e4)


def test_conditional_generation_config_is_read_from_text_config(gemma3_mm_dir, gemma3_dir):
    mm, text = (ModelArchConfig.from_hf(read_config(d)) for d in (gemma3_mm_dir, gemma3_dir))
    assert mm.architecture == "Gemma3ForConditionalGeneration"
    assert mm == ModelArchConfig.from_hf({**read_config(gemma3_dir),
                                          "architectures": [mm.architecture]})
    assert (mm.hidden_size, mm.layer_windows, mm.qk_norm) == (text.hidden_size,
                                                             text.layer_windows, True)


def test_missing_gemma_keys_take_transformers_defaults(gemma2_dir):
    from transformers import Gemma2Config

    cfg = read_config(gemma2_dir)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "sliding_window", "head_dim", "hidden_activation", "tie_word_embeddings"):
        del cfg[key]
    arch, hf = ModelArchConfig.from_hf(cfg), Gemma2Config()
    assert (arch.query_pre_attn_scalar, arch.attn_logit_softcapping,
            arch.final_logit_softcapping, arch.sliding_window, arch.head_dim,
            arch.tie_word_embeddings) == (
        hf.query_pre_attn_scalar, hf.attn_logit_softcapping, hf.final_logit_softcapping,
        hf.sliding_window, hf.head_dim, hf.tie_word_embeddings)
    assert arch.hidden_act == "gelu_pytorch_tanh"


def test_refusals_name_what_is_unsupported(gemma3_dir, llama_dir, qwen2_dir):
    cfg = read_config(gemma3_dir)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelArchConfig.from_hf({**cfg, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="hidden_act 'gelu_new'.*Gemma3ForCausalLM"):
        ModelArchConfig.from_hf({**cfg, "hidden_activation": "gelu_new"})
    llama = read_config(llama_dir)
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh'.*only silu"):
        ModelArchConfig.from_hf({**llama, "hidden_act": "gelu_pytorch_tanh"})
    qwen2 = read_config(qwen2_dir)
    chunked = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelArchConfig.from_hf({**qwen2, "use_sliding_window": True, "layer_types": chunked})

