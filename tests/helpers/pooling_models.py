"""Tiny embedding models for the pooling tests, and HF transformers' embeddings of them.

`make_embedding_model` saves a random-weight decoder as a sentence-transformers directory:
modules.json (Transformer, Pooling, optionally Normalize) and `1_Pooling/config.json`, either
as a bare `*Model` (weights without the `model.` prefix, no LM head: how Qwen3-Embedding
ships) or as a `*ForCausalLM` checkpoint (prefixed, with an LM head the pooling runner skips).
`hf_embeddings` is the reference: `AutoModel`'s `last_hidden_state` (after the final norm),
pooled and normalised the same way, in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers.hf_models import (
    _ARCH_CONFIGS,
    HF_ATTENTION,
    TINY_CONFIG,
    _randomise_biases_and_norms,
    build_tokenizer,
)

ST_POOLING_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                    "cls": "pooling_mode_cls_token"}


def make_embedding_model(out_dir: str | Path, arch: str = "qwen3", *, pooling: str = "last",
                         normalize: bool = True, bare: bool = True, seed: int = 0) -> Path:
    """A tiny random `arch` (llama, qwen3, ...) saved for sentence-transformers, pooling `last`,
    `mean` or `cls`, with a Normalize module when `normalize`; `bare`: as HF's `*Model`."""
    import torch
    import transformers

    config_name, causal_name = _ARCH_CONFIGS[arch]
    config = getattr(transformers, config_name)(**TINY_CONFIG)
    torch.manual_seed(seed)
    model_cls = causal_name.replace("ForCausalLM", "Model") if bare else causal_name
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    _randomise_biases_and_norms(model)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, vocab_size=config.vocab_size)
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {mode: mode == ST_POOLING_MODES[pooling] for mode in (
        *ST_POOLING_MODES.values(), "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, **modes, "include_prompt": True}))
    return out


def hf_embeddings(model_dir: str | Path, prompts: list[list[int]], pooling: str = "last",
                  normalize: bool = True, dimensions: int | None = None):
    """HF transformers' embedding of each prompt, float32 [len(prompts), D]: the final hidden
    states (`AutoModel`'s last_hidden_state) pooled (`last`, `mean`, `cls`), truncated to
    `dimensions`, then L2-normalised where asked."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32,
                                      attn_implementation=HF_ATTENTION).eval()
    vectors = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [T, H]
            vectors.append({"last": hidden[-1], "mean": hidden.mean(0),
                            "cls": hidden[0]}[pooling])
    out = torch.stack(vectors)[:, :dimensions]
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out
