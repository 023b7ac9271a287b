"""Every error case answers with its status and OpenAI's error shape, reaches no engine, and
leaves the server serving."""

from __future__ import annotations

import httpx
import pytest
from helpers.server import assert_error, serving, tiny_app

from aserve.server import ServerConfig

pytestmark = pytest.mark.spawns  # a uvicorn server on a port


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", **body})


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "x"}, "suffix"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_invalid_completion_fields_are_400(server_url, body, param):
    assert_error(completion(server_url, **body), 400, param)


def test_context_length_errors_use_vllms_wording(server_url):
    assert_error(completion(server_url, prompt=[5] * 300), 400,
                 contains="maximum context length is 256 tokens")
    too_long = completion(server_url, prompt=[5] * 100, max_tokens=200)
    assert_error(too_long, 400, "max_tokens", contains="However, you requested 300 tokens "
                 "(100 in the messages, 200 in the completion)")


def test_out_of_vocabulary_tokens_are_400(server_url):
    assert_error(completion(server_url, prompt=[5, 10**7]), 400, contains="out of vocabulary")
    assert_error(httpx.post(f"{server_url}/detokenize", json={"tokens": [10**7]}), 400)


def test_chat_errors(server_url):
    url = f"{server_url}/v1/chat/completions"
    assert_error(httpx.post(url, json={"model": "tiny", "messages": []}), 400, "messages")
    assert_error(httpx.post(url, json={"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    assert_error(httpx.post(url, json={"model": "tiny", "top_logprobs": 3, "messages": [
        {"role": "user", "content": "Hi"}]}), 400, "top_logprobs")


def test_unknown_model_is_404_and_unknown_route_too(server_url):
    assert_error(completion(server_url, model="gpt-4"), 404, "model")
    assert_error(httpx.get(f"{server_url}/v2/nothing"), 404)


def test_malformed_json_is_400(server_url):
    response = httpx.post(f"{server_url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_the_server_still_serves_after_errors(server_url):
    for _ in range(3):
        completion(server_url, temperature=-1)
        completion(server_url, prompt=[5] * 300)
    ok = completion(server_url, max_tokens=4, temperature=0, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(f"{server_url}/metrics").text
    assert 'aserve:num_requests_running{model_name="tiny"} 0.0' in metrics


def test_api_key_is_required_under_v1(model_dir_factory):
    app = tiny_app(model_dir_factory("llama"), ServerConfig(served_model_name="tiny",
                                                             api_key="secret"))
    with serving(app) as url:
        assert_error(httpx.get(f"{url}/v1/models"), 401)
        assert_error(httpx.get(f"{url}/v1/models",
                               headers={"Authorization": "Bearer wrong"}), 401)
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
