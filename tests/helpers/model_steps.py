"""Driving a model loaded by `load_model` step by step through a paged KV cache on the CPU
platform's kernels, and HF's logits to compare with: for the model-level tests."""

from __future__ import annotations

import dataclasses

import torch

from aserve.backends import CpuPlatform
from aserve.config import ModelConfig
from aserve.layers import bind_ops
from aserve.models import load_model
from helpers.attention import build_metadata
from helpers.hf_models import load_hf_model

BLOCK_SIZE = 4


def load(model_dir, dtype="float32", **kwargs):
    return load_model(ModelConfig(model=str(model_dir), dtype=dtype, **kwargs))


def hf_logits(model_dir, ids, dtype=torch.float32):
    hf = load_hf_model(model_dir, dtype)
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()  # [L, vocab]


def bind_cache(model, arch, num_blocks=32, dtype=torch.float32, pack=False) -> int:
    """The CPU platform's kernels for `dtype` (linear weights packed only with `pack`) and a KV
    cache; returns how many weights were packed."""
    ops = CpuPlatform().kernel_ops(dtype)
    num_packed = bind_ops(model, ops if pack else dataclasses.replace(ops, pack_linears=None))
    for layer in model.attention_layers():
        layer.bind_kv_cache(torch.zeros(2, num_blocks, BLOCK_SIZE, arch.num_kv_heads,
                                        arch.head_dim, dtype=dtype))
    return num_packed


def step(model, chunks):
    """One forward of a ragged batch. chunks: (all tokens so far, num new, block ids) per request;
    returns float32 logits of the new tokens of each request, concatenated."""
    ids = torch.cat([tokens[-n:] for tokens, n, _ in chunks])
    positions = torch.cat([torch.arange(len(t) - n, len(t)) for t, n, _ in chunks])
    md = build_metadata([n for _, n, _ in chunks], [len(t) for t, _, _ in chunks],
                        [b for _, _, b in chunks], BLOCK_SIZE)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, md))


def prompt(length=21, seed=0):
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed))
