"""Fixtures of the tokenizer tests: one tiny byte-level BPE tokenizer directory (with a chat
template), aserve's `Tokenizer` over it, and transformers' AutoTokenizer over the same files."""

from __future__ import annotations

import pathlib

import pytest
from helpers.hf_models import build_tokenizer

from aserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tokenizer directory (tokenizer.json, tokenizer_config.json); tests that change it
    work on a copy."""
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tok(model_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf(model_dir: pathlib.Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)
