"""The pooling routes over HTTP: `/v1/embeddings` through the real `openai` SDK (float and its
default base64), `/v1/score` and `/rerank` with their aliases, all equal to HF transformers'
embeddings of a tiny Qwen3Model pooled the same way (float32, 1e-4), under chunked prefill and
batching; the 400s (each runner asked for the other's work, bad dimensions, empty or mismatched
inputs) leave the engine serving."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from helpers.pooling_models import hf_embeddings, make_embedding_model
from helpers.server import assert_error, serving, tiny_app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.spawns  # uvicorn servers on ports

PROMPTS = [list(range(7, 7 + n)) for n in (19, 4, 11)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_embedding_model(tmp_path_factory.mktemp("q3"), "qwen3", pooling="last")


@pytest.fixture(scope="module")
def url(model_dir):
    # 8-token steps: the prompts are chunked and batched together
    with serving(tiny_app(model_dir, max_num_batched_tokens=8, block_size=4)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def tokens_of(url: str, text: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]


def test_embeddings_through_the_sdk_equal_hf_in_float_and_base64(client, model_dir):
    expected = hf_embeddings(model_dir, PROMPTS, "last")
    for encoding in ("float", "base64", None):  # None: the SDK asks for base64 and decodes it
        kwargs = {"encoding_format": encoding} if encoding else {}
        out = client.embeddings.create(model="tiny", input=PROMPTS, **kwargs)
        assert [d.index for d in out.data] == [0, 1, 2] and out.model == "tiny"
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, PROMPTS))
        got = torch.tensor(np.stack([
            np.frombuffer(base64.b64decode(d.embedding), "<f4") if encoding == "base64"
            else np.asarray(d.embedding, np.float32) for d in out.data]))
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    short = client.embeddings.create(model="tiny", input=PROMPTS[0], dimensions=16)
    torch.testing.assert_close(torch.tensor([short.data[0].embedding]),
                               hf_embeddings(model_dir, PROMPTS[:1], "last", dimensions=16),
                               atol=ATOL, rtol=0)


def test_base64_is_little_endian_float32_of_the_float_answer(url):
    body = {"model": "tiny", "input": "The quick brown fox"}
    floats = httpx.post(f"{url}/v1/embeddings", json=body).json()["data"][0]["embedding"]
    encoded = httpx.post(f"{url}/v1/embeddings",
                         json={**body, "encoding_format": "base64"}).json()["data"][0]
    decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats, abs=0) and encoded["object"] == "embedding"


def test_score_and_rerank_are_cosines_of_hf_embeddings(url, model_dir):
    query, docs = "The quick brown fox", ["Hello! How are you?", "The quick brown dog", "中文"]
    ids = [tokens_of(url, t) for t in (query, *docs)]
    vectors = hf_embeddings(model_dir, ids, "last").double()
    cosines = (vectors[1:] @ vectors[0]).tolist()  # (normalised vectors)
    for path in ("/v1/score", "/score"):
        out = httpx.post(f"{url}{path}", json={"model": "tiny", "text_1": query,
                                               "text_2": docs}).json()
        assert out["object"] == "list" and out["id"] and out["created"] > 0
        assert [d["index"] for d in out["data"]] == [0, 1, 2]
        assert [d["score"] for d in out["data"]] == pytest.approx(cosines, abs=ATOL)
    pairwise = httpx.post(f"{url}/v1/score", json={"text_1": [query, docs[0]],
                                                   "text_2": docs[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [cosines[0], float(vectors[1] @ vectors[2])], abs=ATOL)
    order = sorted(range(3), key=lambda i: -cosines[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        out = httpx.post(f"{url}{path}", json={"query": query, "documents": [
            docs[0], {"text": docs[1]}, docs[2]], "top_n": 2}).json()
        assert [r["index"] for r in out["results"]] == order[:2]
        assert [r["relevance_score"] for r in out["results"]] == pytest.approx(
            [cosines[i] for i in order[:2]], abs=ATOL)
        assert [r["document"]["text"] for r in out["results"]] == [docs[i] for i in order[:2]]
        assert out["usage"]["total_tokens"] == sum(map(len, ids))
    bare = httpx.post(f"{url}/rerank", json={"query": query, "documents": docs,
                                             "return_documents": False}).json()
    assert [r["index"] for r in bare["results"]] == order
    assert all(r["document"] is None for r in bare["results"])


@pytest.mark.parametrize("path, body, param, contains", [
    ("/v1/embeddings", {"input": "Hi", "dimensions": 0}, "dimensions", ""),
    ("/v1/embeddings", {"input": "Hi", "dimensions": 65}, "dimensions", "hidden size (64)"),
    ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/embeddings", {"input": "Hi", "encoding_format": "int8"}, "encoding_format", ""),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "N:N"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1", ""),
    ("/rerank", {"query": "a", "documents": []}, "documents", ""),
    ("/v1/completions", {"prompt": "Hi"}, None, "--runner generate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, None,
     "--runner generate"),
])
def test_bad_requests_are_400s_naming_the_field_and_the_engine_serves_on(url, path, body,
                                                                         param, contains):
    assert_error(httpx.post(f"{url}{path}", json=body), 400, param, contains)
    ok = httpx.post(f"{url}/v1/embeddings", json={"input": "still serving"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_health_probe_pools_on_the_pooling_runner(url):
    assert httpx.get(f"{url}/health", params={"generate": "1"}).status_code == 200


def test_a_generating_model_refuses_the_pooling_routes(model_dir_factory):
    with serving(tiny_app(model_dir_factory("llama"))) as base:
        for path, body in (("/v1/embeddings", {"input": "Hi"}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]})):
            assert_error(httpx.post(f"{base}{path}", json=body), 400, None,
                         "--runner pooling")


VALID = {"/v1/embeddings": {"model": "tiny", "input": ["Hi", "there"], "dimensions": 8,
                            "encoding_format": "base64", "normalize": False},
         "/v1/score": {"model": "tiny", "text_1": "Hi", "text_2": ["a", "b"]},
         "/rerank": {"model": "tiny", "query": "Hi", "documents": ["a", {"text": "b"}],
                     "top_n": 1, "return_documents": True}}
SCALARS = (st.none() | st.booleans() | st.integers() | st.text(max_size=8)
           | st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_valid_body_with_one_field_replaced_is_never_a_5xx(url, data):
    path = data.draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[path])
    body[data.draw(st.sampled_from(sorted(body)))] = data.draw(JSON)
    response = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_error(response, response.status_code)
