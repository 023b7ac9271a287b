"""The token bitmask ops of aserve/structured_output/grammar.py: `GrammarMatcher.fill_bitmask`
writes what llguidance.torch's wrapper writes (an ended grammar: EOS only) without importing
torch._dynamo as that wrapper does; `apply_token_bitmask` equals its reference twin bit for bit
(every vocabulary size, row selection, dtype and special value) and leaves its input alone;
`masked_argmax` is the argmax of the masked logits; held-back stop tokens leave a mask unless
they are all it allows.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aserve.engine.tokenizer import Tokenizer
from aserve.sampling_params import StructuredOutputsParams
from aserve.structured_output import (
    GrammarCompiler,
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask,
    fill_token_bitmask,
    masked_argmax,
)
from aserve.structured_output.grammar import apply_token_bitmask_ref

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                  "maxItems": 2}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(llama_dir) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(llama_dir)
    return GrammarCompiler(tokenizer.backend, 512, tokenizer.eos_token_ids)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    return [t for t in range(vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch._dynamo, imported by it
def test_fill_bitmask_writes_what_llguidance_torch_writes(compiler):
    import llguidance.torch

    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-c]{1,3}"),
             StructuredOutputsParams(choice=["yes", "no"])]
    matchers = [GrammarMatcher(compiler.compile(specs[i % 3])) for i in range(6)]
    rng, num_ended = random.Random(0), 0
    for _ in range(60):
        ours, theirs = allocate_token_bitmask(6, 512), allocate_token_bitmask(6, 512)
        for i, matcher in enumerate(matchers):
            matcher.fill_bitmask(ours, i)
            if not matcher.is_terminated:  # (an ended grammar: the stop tokens, ours only)
                llguidance.torch.fill_next_token_bitmask(matcher._matcher, theirs, i)
                assert torch.equal(ours[i], theirs[i])
        num_ended = sum(m.is_terminated for m in matchers)
        for i, matcher in enumerate(matchers):
            if not matcher.is_terminated:
                assert matcher.accept_token(rng.choice(allowed_ids(ours, i, 512)))
    assert num_ended > 0
    ended = next(i for i, m in enumerate(matchers) if m.is_terminated)
    assert allowed_ids(ours, ended, 512) == [2]  # EOS only


@pytest.mark.spawns  # a fresh interpreter: what the first constrained step imports
def test_filling_a_bitmask_does_not_import_torch_dynamo(llama_dir):
    code = f"""
import sys
from aserve.engine.tokenizer import Tokenizer
from aserve.sampling_params import StructuredOutputsParams
from aserve.structured_output import GrammarCompiler, GrammarMatcher, allocate_token_bitmask
tokenizer = Tokenizer.from_dir({str(llama_dir)!r})
compiler = GrammarCompiler(tokenizer.backend, 512, tokenizer.eos_token_ids)
matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex="a+")))
matcher.fill_bitmask(allocate_token_bitmask(1, 512), 0)
assert "torch._dynamo" not in sys.modules, "imported torch._dynamo"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_fill_bitmask_refuses_a_bitmask_it_cannot_write(compiler):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex="a+")))
    with pytest.raises(ValueError, match="contiguous int32"):
        matcher.fill_bitmask(allocate_token_bitmask(2, 512).to(torch.int64), 0)


@pytest.mark.parametrize("vocab_size", [32, 100, 512, 49157])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_apply_token_bitmask_equals_its_reference(vocab_size, dtype):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=gen).to(dtype)  # [N, V]
    logits[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    before = logits.clone()
    words = -(-vocab_size // 32)
    for rows in (None, torch.tensor([3]), torch.tensor([4, 0, 2]), torch.arange(6)):
        num_rows = 6 if rows is None else len(rows)
        bitmask = torch.randint(-2**31, 2**31, (num_rows, words), dtype=torch.int32,
                                generator=gen)
        bitmask[0, 0] = 0b1010  # tokens 1 and 3 only
        out = apply_token_bitmask(logits, bitmask, rows)
        assert out.dtype == dtype
        assert torch.equal(bits(out), bits(apply_token_bitmask_ref(logits, bitmask, rows)))
    assert torch.equal(bits(logits), bits(before))  # a new tensor: the input is as it was


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN, -0.0 and all compare as themselves)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 77, 512])
def test_masked_argmax_is_the_argmax_of_the_masked_logits(vocab_size):
    """Sparse masks (a few words) take the gather, dense ones the masked copy; both give what
    the reference mask and an argmax give: ties to the lowest id, tokens past the vocabulary
    never, a row allowing nothing token 0."""
    gen = torch.Generator().manual_seed(vocab_size)
    for density in (0.0, 0.002, 0.05, 0.5, 1.0):
        logits = torch.randint(-3, 3, (6, vocab_size), generator=gen).float()  # many ties
        rows = torch.randperm(6, generator=gen)[:4]
        allowed = torch.rand(4, -(-vocab_size // 32) * 32, generator=gen) < density
        bitmask = pack(allowed)
        expected = apply_token_bitmask_ref(logits[rows], bitmask).argmax(dim=-1)
        assert torch.equal(masked_argmax(logits, rows, bitmask), expected), density


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, 32 W] -> the int32 bitmask [R, W] allowing those tokens."""
    words = torch.zeros(allowed.shape[0], allowed.shape[1] // 32, dtype=torch.int64)
    for j in range(32):
        words |= allowed[:, j::32].long() << j
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def test_held_stop_tokens_are_blocked_unless_they_are_all_the_grammar_allows(compiler):
    """A request short of its min_tokens: its stop tokens leave the mask while the grammar
    allows something else ("a+" after "a": more a's); a grammar that has ended keeps them."""
    eos = compiler.tokenizer.eos_tokens[0]
    more = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex="a+")))
    ended = GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=["a"])))
    for matcher in (more, ended):
        a = [t for t in range(512) if matcher.allows(t)][0]
        assert matcher.accept_token(a)
    free = fill_token_bitmask([more, ended], 512, [[], []])
    held = fill_token_bitmask([more, ended], 512, [[eos], [eos]])
    assert eos in allowed_ids(free, 0, 512) and eos not in allowed_ids(held, 0, 512)
    assert set(allowed_ids(held, 0, 512)) == set(allowed_ids(free, 0, 512)) - {eos}
    assert allowed_ids(held, 1, 512) == allowed_ids(free, 1, 512) == [eos]
    assert ended.is_terminated and more.allows(eos) and not ended.allows(eos + 1)
