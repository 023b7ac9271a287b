"""The real `openai` SDK against a uvicorn server: completions and chat, streaming or not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from aserve import LLM, SamplingParams

pytestmark = pytest.mark.spawns  # a uvicorn server on a port


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_models_retrieve_gives_the_card_or_404(client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    assert card.model_dump()["max_model_len"] == client.models.list().data[0].max_model_len
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/other-model")  # (an id with a slash reaches the route)
    assert err.value.body["param"] == "model" and "org/other-model" in err.value.message


def test_metrics_are_also_under_vllm_names(client, server_url):
    """vLLM's dashboards read `vllm:` families: each `aserve:` one is there too, same values."""
    client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    text = httpx.get(f"{server_url}/metrics").text
    ours = {line.split(" ")[0][len("aserve:"):]: line.split(" ")[-1]
            for line in text.splitlines() if line.startswith("aserve:")}
    theirs = {line.split(" ")[0][len("vllm:"):]: line.split(" ")[-1]
              for line in text.splitlines() if line.startswith("vllm:")}
    assert ours == theirs and 'generation_tokens_total{model_name="tiny"}' in theirs
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_completion_non_streaming_and_streaming_agree(client):
    kwargs = dict(model="tiny", prompt="Hello! How are you?", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_non_streaming_and_streaming_agree(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                  max_completion_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_two_gives_two_choices(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, n=2,
                                    temperature=1.0, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1]
    chat = client.chat.completions.create(model="tiny", n=2, max_tokens=5, seed=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs_are_well_formed(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    # top-3 plus the chosen token, keyed by token text (distinct byte tokens may share a text)
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and max(top.values()) <= 0
        assert logprob == max(top.values())  # greedy: the chosen token is the most likely
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_server_greedy_equals_offline_llm(client, model_dir_factory):
    prompts = ["Hello! How are you?", "The quick brown fox", "中文文本测试"]
    llm = LLM(str(model_dir_factory("llama")), dtype="float32", max_model_len=256)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    for prompt, expected in zip(prompts, offline):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected.outputs[0].text
    batch = client.completions.create(model="tiny", prompt=[o.prompt_token_ids for o in offline],
                                      max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in batch.choices] == [o.outputs[0].text for o in offline]


def test_health_version_tokenize_detokenize(server_url):
    assert httpx.get(f"{server_url}/health").status_code == 200
    assert httpx.get(f"{server_url}/version").json()["version"]
    tok = httpx.post(f"{server_url}/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    text = httpx.post(f"{server_url}/detokenize",
                      json={"model": "tiny", "tokens": tok["tokens"]}).json()
    assert text == {"prompt": "Hello"}
    chat = httpx.post(f"{server_url}/tokenize", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tok["count"]


def test_metrics_expose_vllm_style_names(server_url, client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    text = httpx.get(f"{server_url}/metrics").text
    for name in ("aserve:num_requests_running", "aserve:num_requests_waiting",
                 "aserve:kv_cache_usage_perc", "aserve:prefix_cache_queries_total",
                 "aserve:prefix_cache_hits_total", "aserve:num_preemptions_total",
                 "aserve:prompt_tokens_total", "aserve:generation_tokens_total",
                 "aserve:request_success_total", "aserve:time_to_first_token_seconds_bucket",
                 "aserve:inter_token_latency_seconds_bucket",
                 "aserve:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert 'model_name="tiny"' in text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_and_n_gives_every_choice_the_prompt_once(server_url, stream):
    """`echo` + `logprobs` + `n` > 1 was a 500: each child's prompt logprobs were appended to
    the parent's list, so it held the prompt n times."""
    body = {"model": "tiny", "prompt": ["Hello there", "Bye"], "max_tokens": 3, "n": 3,
            "echo": True, "logprobs": 1, "temperature": 1.0, "seed": 5, "stream": stream}
    single = httpx.post(f"{server_url}/v1/completions", timeout=60,
                        json={**body, "prompt": "Hello there", "n": 1, "stream": False,
                              "max_tokens": 1}).json()["choices"][0]["logprobs"]
    response = httpx.post(f"{server_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert not any("error" in c for c in chunks), chunks
        merged: dict[int, dict] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                lp = merged.setdefault(choice["index"], {"tokens": [], "token_logprobs": []})
                lp["tokens"] += choice["logprobs"]["tokens"]
                lp["token_logprobs"] += choice["logprobs"]["token_logprobs"]
        choices = [{"index": i, "logprobs": lp} for i, lp in merged.items()]
    else:
        choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(6))
    prompt_len = len(single["tokens"]) - 1  # the single request generated one token
    for choice in choices:
        lp = choice["logprobs"]
        if choice["index"] < 3:  # "Hello there"'s choices: its prompt once, then 3 tokens
            assert len(lp["tokens"]) == prompt_len + 3
            assert lp["tokens"][:prompt_len] == single["tokens"][:prompt_len]
            assert lp["token_logprobs"][:prompt_len] == pytest.approx(
                single["token_logprobs"][:prompt_len], abs=1e-4)
        assert lp["token_logprobs"][0] is None  # the first prompt token has no logprob
        assert all(x is not None for x in lp["token_logprobs"][1:])


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    """lm-eval's loglikelihood path: the prompt echoed with its tokens' logprobs, nothing
    generated, streamed or not; the logprobs are those of a generating request's echo; without
    echo, max_tokens 0 is a 400 naming the field."""
    prompt = "The capital of France is Paris"
    kwargs = dict(model="tiny", prompt=prompt, echo=True, logprobs=1, temperature=0)
    scored = client.completions.create(**kwargs, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == scored.usage.prompt_tokens
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    generating = client.completions.create(**kwargs, max_tokens=3).choices[0].logprobs
    assert generating.token_logprobs[:len(lp.tokens)] == lp.token_logprobs
    chunks = list(client.completions.create(**kwargs, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert "max_tokens" in err.value.message
