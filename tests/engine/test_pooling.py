"""The pooling runner offline (`LLM.embed`, `LLM.score`): embeddings equal HF transformers'
`AutoModel` hidden states pooled the same way (float32, 1e-4), whatever the chunking and
batching; a bare `Qwen3Model` checkpoint (no `model.` prefix, no LM head) and a
`LlamaForCausalLM` one (its LM head skipped) both load; each runner refuses the other's work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pooling_models import hf_embeddings, make_embedding_model

from aserve import LLM, PoolingParams, SamplingParams

PROMPTS = [list(range(5, 5 + n)) for n in (3, 21, 9, 17, 1)]  # chunked at 8, batched together
ATOL = 1e-4


@pytest.fixture(scope="module")
def qwen3_last_dir(tmp_path_factory):
    """Qwen3-Embedding's shape: a bare Qwen3Model, last-token pooling, normalised."""
    return make_embedding_model(tmp_path_factory.mktemp("q3"), "qwen3", pooling="last")


@pytest.fixture(scope="module")
def llama_mean_dir(tmp_path_factory):
    """A LlamaForCausalLM checkpoint with mean pooling and no Normalize module."""
    return make_embedding_model(tmp_path_factory.mktemp("llama"), "llama", pooling="mean",
                                normalize=False, bare=False)


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=128, block_size=4,
               max_num_batched_tokens=8, **kwargs)


def embed(llm: LLM, params=None) -> torch.Tensor:
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS and all(o.finished for o in outputs)
    return torch.tensor(np.stack([o.outputs.data for o in outputs]))


def test_embeddings_equal_hf_for_each_pooling_under_chunks_and_batching(qwen3_last_dir):
    with make_llm(qwen3_last_dir) as llm:  # auto: modules.json's Pooling module → pooling
        last = embed(llm)
        torch.testing.assert_close(last, hf_embeddings(qwen3_last_dir, PROMPTS, "last"),
                                   atol=ATOL, rtol=0)
        assert torch.allclose(last.norm(dim=-1), torch.ones(len(PROMPTS)))
        mean = embed(llm, PoolingParams(pooling_type="MEAN"))
        torch.testing.assert_close(mean, hf_embeddings(qwen3_last_dir, PROMPTS, "mean"),
                                   atol=ATOL, rtol=0)
        cls = embed(llm, PoolingParams(pooling_type="CLS"))
        torch.testing.assert_close(cls, hf_embeddings(qwen3_last_dir, PROMPTS, "cls"),
                                   atol=ATOL, rtol=0)
        assert (mean - last)[:-1].abs().max() > 0.1  # (a one-token prompt pools the same)
        # Matryoshka: truncated, then normalised; normalize=False: the raw hidden state
        short = embed(llm, PoolingParams(dimensions=16))
        torch.testing.assert_close(short, hf_embeddings(qwen3_last_dir, PROMPTS, "last",
                                                        dimensions=16), atol=ATOL, rtol=0)
        raw = embed(llm, PoolingParams(normalize=False))
        torch.testing.assert_close(raw, hf_embeddings(qwen3_last_dir, PROMPTS, "last",
                                                      normalize=False), atol=ATOL, rtol=0)
        hits = llm.stats().prefix_cache_hits
        again = embed(llm)  # the prompts' blocks are cached now: last-token pooling hits them
        assert llm.stats().prefix_cache_hits > hits
        torch.testing.assert_close(again, last, atol=ATOL, rtol=0)


def test_a_causal_checkpoint_pools_as_its_sentence_transformers_config_says(llama_mean_dir):
    with make_llm(llama_mean_dir, async_scheduling=False) as llm:
        mean = embed(llm)
        expected = hf_embeddings(llama_mean_dir, PROMPTS, "mean", normalize=False)
        torch.testing.assert_close(mean, expected, atol=ATOL, rtol=0)
        assert mean.norm(dim=-1).sub(1).abs().min() > 1e-2  # not normalised
        hits = llm.stats().prefix_cache_hits
        torch.testing.assert_close(embed(llm), mean, atol=ATOL, rtol=0)
        assert llm.stats().prefix_cache_hits == hits  # mean pooling reads every token


def test_score_is_the_cosine_of_the_two_embeddings(qwen3_last_dir):
    texts = ["The quick brown fox", "jumps over the lazy dog", "Hello! How are you?"]
    with make_llm(qwen3_last_dir) as llm:
        vectors = [o.outputs.data.astype(np.float64) for o in llm.embed(texts)]

        def cos(a, b):
            return a @ b / np.linalg.norm(a) / np.linalg.norm(b)

        one_to_n = llm.score(texts[0], texts)
        assert [s.outputs.score for s in one_to_n] == pytest.approx(
            [cos(vectors[0], v) for v in vectors], abs=1e-6)
        assert one_to_n[0].outputs.score == pytest.approx(1.0)
        n_to_n = llm.score(texts[:2], texts[1:])
        assert [s.outputs.score for s in n_to_n] == pytest.approx(
            [cos(vectors[0], vectors[1]), cos(vectors[1], vectors[2])], abs=1e-6)
        with pytest.raises(ValueError, match="text_2"):
            llm.score(texts[:2], texts)
        with pytest.raises(ValueError, match="--runner generate"):
            llm.generate("Hello", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="hidden size"):
            llm.embed("Hello", PoolingParams(dimensions=65))


def test_each_runner_refuses_the_others_work(qwen3_last_dir, llama_mean_dir):
    with pytest.raises(ValueError, match="--runner pooling"):
        make_llm(qwen3_last_dir, runner="generate")  # a bare decoder has no LM head
    with make_llm(llama_mean_dir, runner="generate") as llm:  # a causal LM: it generates
        assert len(llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))[0]
                   .outputs[0].token_ids) == 3
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed("Hello")
