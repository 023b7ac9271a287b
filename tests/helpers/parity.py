"""What the greedy-parity test files share: HF's reference run of a tiny model (prompts, greedy
continuations, logits), a variant of its HF model with a config key changed (to show that a
feature changes HF's output), and aserve's greedy run of the same prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from aserve import LLM, SamplingParams
from helpers.hf_models import hf_greedy, load_hf_model

PROMPT_LENS = [20, 37, 60]
NUM_NEW = 32


@dataclass
class Reference:
    name: str
    model_dir: Path
    prompts: list[list[int]]
    outputs: list[list[int]]  # HF's greedy continuations
    logits: list[torch.Tensor]  # HF's raw logits of each step, [NUM_NEW, vocab] per prompt


def hf_reference(name: str, model_dir: Path, prompt_lens: list[int] = PROMPT_LENS,
                 num_new: int = NUM_NEW) -> Reference:
    """HF's greedy run (float32) of random prompts (seed 0) of these lengths."""
    model = load_hf_model(model_dir)
    rng = random.Random(0)
    vocab = model.config.get_text_config().vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in prompt_lens]
    outputs, logits = hf_greedy(model, prompts, num_new, with_logits=True)
    return Reference(name, model_dir, prompts, outputs, logits)


def hf_variant(model_dir: Path, **text_config):
    """HF's model of `model_dir` with its (text) config changed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in text_config.items():
        setattr(config.get_text_config(), key, value)
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config,
                                                dtype=torch.float32).eval()


def greedy(num_new: int = NUM_NEW, **extra) -> SamplingParams:
    """Exactly `num_new` greedy tokens, EOS banned until then: `hf_greedy`'s min_new_tokens
    (`ignore_eos` would let EOS be chosen, which HF's run never does)."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": num_new, "min_tokens": num_new,
                             **extra})


def generate_ids(llm: LLM, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(num_new))
    return [o.outputs[0].token_ids for o in outputs]
