"""The pooling runner under tensor parallelism (2 CPU ranks, gloo): every TP rank holds every
row's final hidden state, so rank 0 pools them as one rank does — embeddings equal HF
transformers' (float32, 1e-4) for last-token and mean pooling, chunked and batched."""

from __future__ import annotations

import numpy as np
import torch
from helpers.pooling_models import hf_embeddings, make_embedding_model

from aserve import LLM, PoolingParams


def test_tp2_embeddings_equal_hf(tmp_path):
    model_dir = make_embedding_model(tmp_path / "qwen3", "qwen3", pooling="last")
    prompts = [list(range(5, 5 + n)) for n in (3, 21, 9)]
    with LLM(str(model_dir), dtype="float32", max_model_len=128, block_size=4,
             max_num_batched_tokens=8, tensor_parallel_size=2) as llm:
        for pooling in ("last", "mean"):
            outputs = llm.embed([{"prompt_token_ids": p} for p in prompts],
                                PoolingParams(pooling_type=pooling.upper()))
            got = torch.tensor(np.stack([o.outputs.data for o in outputs]))
            torch.testing.assert_close(got, hf_embeddings(model_dir, prompts, pooling),
                                       atol=1e-4, rtol=0)
