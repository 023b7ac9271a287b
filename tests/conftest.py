"""Session-wide fixtures: tiny HF model directories built once per (arch, overrides)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.hf_models import make_hf_model

if not torch.cuda.is_available():  # before any @triton.jit runs: Triton kernels test on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory) -> Callable[..., Path]:
    """`factory(arch="llama", **overrides) -> Path`, cached per (arch, overrides) for the session.

    Overrides are those of `make_hf_model` (config keys, `max_shard_size`, `seed`).
    """
    root = tmp_path_factory.mktemp("hf_models")
    cache: dict[str, Path] = {}

    def factory(arch: str = "llama", **overrides) -> Path:
        key = f"{arch}:{sorted(overrides.items())!r}"
        if key not in cache:
            name = f"{arch}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            cache[key] = make_hf_model(root / name, arch, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def llama_dir(model_dir_factory) -> Path:
    return model_dir_factory("llama")


@pytest.fixture(scope="session")
def mistral_dir(model_dir_factory) -> Path:
    return model_dir_factory("mistral")


@pytest.fixture(scope="session")
def qwen2_dir(model_dir_factory) -> Path:
    return model_dir_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(model_dir_factory) -> Path:
    return model_dir_factory("qwen3")
