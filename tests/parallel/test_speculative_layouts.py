"""Speculative decoding's own models under TP=2, PP=2 and SP=2 (gloo processes): the draft model
and the EAGLE / EAGLE-3 heads live whole on rank 0 and read what they need of the sharded or
staged target (its hidden states of every row, its whole vocabulary tables). The heads'
drafts equal the from-scratch reference's and greedy equals HF's; the target as its own draft
model has every draft accepted (its K/V on rank 0 equals the sharded target's), another one is
exact too. The n-gram and suffix lookups under these layouts: tests/models/
test_speculative_families.py."""

from __future__ import annotations

import random

import pytest
from helpers.eagle_heads import EagleReference, make_eagle_head, record_drafts
from helpers.hf_models import hf_greedy, make_hf_model

from aserve import LLM, SamplingParams

K = 3
AUX = [0, 2, 3]  # with PP=2 over 4 layers: layer 0's stream on stage 0, layers 2 and 3 on 1
NUM_NEW = 16
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
           "sp2": {"sequence_parallel_size": 2}}


@pytest.fixture(autouse=True)
def every_draft_proposed(monkeypatch):
    """The cost policy lifted: the drafter keeps up at every step and drafts as asked."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout_targets")
    # an untied LM head (EAGLE-1 reads it from the last stage), and a tied odd vocabulary
    # (509 rows: the TP shards are padded, the whole table is not)
    return {"untied": make_hf_model(root / "untied", "llama", num_hidden_layers=4),
            "tied": make_hf_model(root / "tied", "llama", num_hidden_layers=4,
                                  vocab_size=509, tie_word_embeddings=True)}


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 12, 21)]


def generate(target, spec: dict, layout: dict, **settings) -> tuple[list[list[int]], object]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(target, dtype="float32", max_model_len=128, block_size=8, speculative_config=spec,
             **layout, **settings) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
        return [o.outputs[0].token_ids for o in outs], llm.stats()


@pytest.mark.parametrize(("method", "which", "layout"), [
    ("eagle3", "untied", "pp2"), ("eagle", "untied", "pp2"), ("eagle", "tied", "tp2"),
    pytest.param("eagle3", "tied", "tp2", marks=pytest.mark.slow),
    pytest.param("eagle", "untied", "sp2", marks=pytest.mark.slow),
    pytest.param("eagle3", "untied", "sp2", marks=pytest.mark.slow),
])
def test_eagle_heads_draft_as_the_reference(monkeypatch, tmp_path, targets, method, which,
                                            layout) -> None:
    target = targets[which]
    version = 3 if method == "eagle3" else 1
    head = make_eagle_head(tmp_path / "head", target, version, seed=4, layers=2,
                           **({"aux_ids": AUX, "draft_vocab": 384} if version == 3 else {}))
    seen = record_drafts(monkeypatch)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
    tokens, stats = generate(target, spec, LAYOUTS[layout], max_num_batched_tokens=16,
                             long_prefill_token_threshold=16)
    assert tokens == hf_greedy(target, prompts(), NUM_NEW)
    assert stats.spec_decode_num_draft_tokens > 0
    reference = EagleReference(target, head, version, AUX)
    assert len(seen) >= 10
    for context, drafts in seen:
        assert drafts == reference.drafts(context, K)[:len(drafts)], context


@pytest.mark.parametrize("layout", [
    "tp2", "pp2", pytest.param("sp2", marks=pytest.mark.slow)])
def test_a_draft_model_on_rank_0(targets, layout) -> None:
    """The target as its own draft model: every draft accepted, so the whole model rank 0
    runs (its K/V included) computes what the split target does; greedy as HF's."""
    target = targets["untied"]
    expected = hf_greedy(target, prompts(), NUM_NEW)
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": K}
    tokens, stats = generate(target, spec, LAYOUTS[layout])
    assert tokens == expected
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


@pytest.mark.slow
def test_another_draft_model_under_tp_and_pp(targets) -> None:
    """A draft model that disagrees (two layers, another seed): its rejections under TP=2 x
    PP=2 leave greedy as HF's."""
    target = targets["untied"]
    draft = make_hf_model(target.parent / "other", "llama", num_hidden_layers=2, seed=9)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    tokens, stats = generate(target, spec, {"tensor_parallel_size": 2,
                                            "pipeline_parallel_size": 2})
    assert tokens == hf_greedy(target, prompts(), NUM_NEW)
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
