"""Long texts: `Tokenizer.encode` takes the GIL-free batch call past `GIL_FREE_ENCODE_CHARS`
with the same ids, and no text longer than `max_token_chars` × tokens fits in that many."""

from __future__ import annotations

import random

import pytest

from aserve.engine import tokenizer as tokenizer_module
from aserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir_factory) -> Tokenizer:
    return Tokenizer.from_dir(model_dir_factory("llama"))


def random_text(seed: int, length: int) -> str:
    rng = random.Random(seed)
    pieces = ["the ", "quick ", "brown ", "fox", "  ", "\n\n", "世界", "é", "<|im_start|>",
              "<|endoftext|>", "1234", "!!", "\t", "Ω", "x" * 40]
    text = ""
    while len(text) < length:
        text += rng.choice(pieces)
    return text


@pytest.mark.parametrize("seed", range(4))
def test_long_texts_get_the_ids_of_a_plain_encode(tokenizer, seed):
    text = random_text(seed, tokenizer_module.GIL_FREE_ENCODE_CHARS + 5000)
    for special in (True, False):
        plain = tokenizer.backend.encode(text, add_special_tokens=special).ids
        assert tokenizer.encode(text, add_special_tokens=special) == plain


@pytest.mark.parametrize("seed", range(8))
def test_no_token_stands_for_more_than_max_token_chars(tokenizer, seed):
    text = random_text(seed, 3000)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(text) <= tokenizer.max_token_chars * len(ids)
    # the bound is an entry's length: a run of one character packs the most
    run = "x" * 5000
    assert len(run) <= tokenizer.max_token_chars * len(tokenizer.encode(run))
