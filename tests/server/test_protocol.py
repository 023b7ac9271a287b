"""The OpenAI wire protocol: bad requests are answered 400 in OpenAI's error shape naming the field,
requests map onto `SamplingParams` field by field, and responses parse with the `openai` SDK's own
types (and through the SDK itself, against an in-process Starlette app)."""

from __future__ import annotations

import json
import math

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from aserve.engine.outputs import Logprob
from aserve.sampling_params import SamplingParams
from aserve.server.errors import (
    EXCEPTION_HANDLERS,
    ErrorResponse,
    ServerError,
    error_response,
    error_type,
    validation_error_response,
)
from aserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from aserve.server.responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    UsageInfo,
    chat_logprobs,
    chat_role_chunk,
    completion_logprobs,
)

USER = [{"role": "user", "content": "hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def error_body(cls, body: dict) -> tuple[int, dict]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(json.dumps(body))
    response = validation_error_response(info.value)
    return response.status_code, json.loads(response.body)


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi"} | fields


def chat(**fields) -> dict:
    return {"model": "m", "messages": USER} | fields


# id: (fields over a valid body, param, words the message contains)
BAD_COMPLETIONS = {
    "max_tokens_not_int": ({"max_tokens": "ten"}, "max_tokens", "valid integer"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens", "greater than"),
    "max_tokens_zero_below_min_tokens": ({"max_tokens": 0, "echo": True, "min_tokens": 2},
                                         "max_tokens", "min_tokens=2"),
    "temperature_not_number": ({"temperature": "hot"}, "temperature", "valid number"),
    "temperature_negative": ({"temperature": -0.5}, "temperature", "greater than"),
    "n_zero": ({"n": 0}, "n", "greater than or equal to 1"),
    "n_string": ({"n": "2"}, "n", "valid integer"),
    "top_p_zero": ({"top_p": 0}, "top_p", "greater than 0"),
    "top_p_above_one": ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    "logprobs_above_20": ({"logprobs": 21}, "logprobs", "20"),
    "logprobs_negative": ({"logprobs": -1}, "logprobs", "greater than"),
    "logprobs_bool": ({"logprobs": True}, "logprobs", "valid integer"),
    "presence_penalty": ({"presence_penalty": 3}, "presence_penalty", "2"),
    "seed_string": ({"seed": "1"}, "seed", "valid integer"),
    "prompt_null": ({"prompt": None}, "prompt", "prompt must"),
    "prompt_empty_list": ({"prompt": []}, "prompt", "empty"),
    "prompt_negative_id": ({"prompt": [1, -2]}, "prompt", "non-negative"),
    "prompt_empty_ids": ({"prompt": [[1], []]}, "prompt", "non-empty"),
    "prompt_number": ({"prompt": 5}, "prompt", "prompt must"),
    "prompt_mixed": ({"prompt": ["a", 1]}, "prompt", "prompt must"),
    "stream_options_no_stream": ({"stream_options": {"include_usage": True}}, "stream_options",
                                 "Stream options can only be defined when `stream=True`."),
    "suffix": ({"suffix": "x"}, "suffix", "suffix is not currently supported"),
    "best_of_above_n": ({"best_of": 2}, "best_of", "best_of"),
    "logit_bias_key": ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    "logit_bias_value": ({"logit_bias": {"5": 101}}, "logit_bias.5", "100"),
    "stop_number": ({"stop": 5}, "stop", "stop must"),
    "stop_list_of_numbers": ({"stop": [1]}, "stop", "stop must"),
}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "http://x"}}
BAD_CHATS = {
    "messages_empty": ({"messages": []}, "messages", "at least 1"),
    "messages_null": ({"messages": None}, "messages", "valid array"),
    "message_not_object": ({"messages": ["hi"]}, "messages.0", "object"),
    "message_no_role": ({"messages": [{"content": "x"}]}, "messages.0.role", "required"),
    "image_part": ({"messages": [{"role": "user", "content": [IMAGE_PART]}]},
                   "messages.0.content", "image_url"),
    "content_number": ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
                       "content must"),
    "tool_choice_required_without_tools": ({"tool_choice": "required"}, None,
                                           "tool_choice needs tools"),
    "tool_choice_unknown_function": (
        {"tools": [{"type": "function", "function": {"name": "f"}}],
         "tool_choice": {"type": "function", "function": {"name": "g"}}}, None,
        "not among the tools"),
    "response_format_unknown": ({"response_format": {"type": "xml"}}, "response_format.type",
                                "xml"),
    "response_format_schema_missing": ({"response_format": {"type": "json_schema"}},
                                       "response_format", "needs json_schema.schema"),
    "top_logprobs_without_logprobs": ({"top_logprobs": 3}, "top_logprobs",
                                      "`logprobs` must be set to true"),
    "top_logprobs_above_20": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    "logprobs_int": ({"logprobs": 5}, "logprobs", "valid boolean"),
    "max_completion_tokens_zero": ({"max_completion_tokens": 0}, "max_completion_tokens",
                                   "greater than"),
    "continue_final_message": ({"continue_final_message": True}, "continue_final_message",
                               "not supported"),
    "stream_options_stream_false": ({"stream": False, "stream_options": {"include_usage": True}},
                                    "stream_options", "stream=True"),
}
BAD_OTHERS = {
    "prompt_missing": (CompletionRequest, {"model": "m"}, "prompt", "required"),
    "messages_missing": (ChatCompletionRequest, {"model": "m"}, "messages", "required"),
    "tokenize_neither": (TokenizeRequest, {"model": "m"}, None, "`prompt`"),
    "tokenize_both": (TokenizeRequest, {"prompt": "x", "messages": USER}, None, "`messages`"),
    "detokenize_negative": (DetokenizeRequest, {"tokens": [1, -1]}, "tokens.1", "greater than"),
    "detokenize_string": (DetokenizeRequest, {"tokens": "abc"}, "tokens", "valid array"),
}
BAD_REQUESTS = (
    {k: (CompletionRequest, completion(**f), p, w) for k, (f, p, w) in BAD_COMPLETIONS.items()}
    | {k: (ChatCompletionRequest, chat(**f), p, w) for k, (f, p, w) in BAD_CHATS.items()}
    | BAD_OTHERS)


@pytest.mark.parametrize("cls, body, param, words", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_answered_400_in_openai_shape_naming_the_field(cls, body, param, words):
    status, payload = error_body(cls, body)
    assert status == 400
    assert set(payload) == {"error"} and set(payload["error"]) == ERROR_KEYS
    error = payload["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert words in error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"]


def test_malformed_json_is_a_400_not_a_crash():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b'{"prompt": ')
    payload = json.loads(validation_error_response(info.value).body)
    assert payload["error"]["code"] == 400 and "Invalid JSON" in payload["error"]["message"]


def test_several_bad_fields_are_all_named():
    _, payload = error_body(CompletionRequest, completion(n=0, temperature="hot"))
    assert "n:" in payload["error"]["message"] and "temperature" in payload["error"]["message"]


GOOD_REQUESTS = {
    "unknown_fields_ignored": (CompletionRequest, completion(foo=1, extra_body={"x": 2})),
    "nulls_mean_defaults": (CompletionRequest, completion(
        temperature=None, top_p=None, n=None, stop=None, max_tokens=None, echo=None)),
    "int_temperature": (CompletionRequest, completion(temperature=0)),
    "empty_string_prompt": (CompletionRequest, completion(prompt="")),  # BOS may make it non-empty
    "token_id_lists": (CompletionRequest, completion(prompt=[[1, 2], [3]])),
    "best_of_equals_n": (CompletionRequest, completion(n=2, best_of=2)),
    "stream_with_options": (CompletionRequest, completion(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": False})),
    "text_parts": (ChatCompletionRequest, chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bob"}])),
    "empty_tools_and_none_choice": (ChatCompletionRequest, chat(tools=[], tool_choice="none")),
    "text_response_format": (ChatCompletionRequest, chat(response_format={"type": "text"})),
    "top_logprobs_zero_alone": (ChatCompletionRequest, chat(top_logprobs=0)),
    "assistant_without_content": (ChatCompletionRequest, chat(messages=USER + [
        {"role": "assistant", "content": None}])),
}


@pytest.mark.parametrize("cls, body", GOOD_REQUESTS.values(), ids=GOOD_REQUESTS.keys())
def test_valid_request_is_accepted(cls, body):
    cls.model_validate_json(json.dumps(body))


def test_chat_content_parts_flatten_for_the_template():
    request = ChatCompletionRequest.model_validate(chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "bob"}]))
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "bob"}]


def test_completion_prompts_are_listed_one_per_prompt():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_stream_usage_flags_need_stream_and_include_usage():
    plain = CompletionRequest.model_validate(completion(stream=True))
    usage = CompletionRequest.model_validate(completion(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert not plain.include_usage and not plain.continuous_usage_stats
    assert usage.include_usage and usage.continuous_usage_stats


def test_tokenize_request_defaults_add_special_tokens_by_kind():
    assert TokenizeRequest.model_validate({"prompt": "x"}).add_special_tokens is True
    chat_tok = TokenizeRequest.model_validate({"messages": USER})
    assert chat_tok.add_special_tokens is False and chat_tok.add_generation_prompt is True
    assert chat_tok.template_messages() == USER
    explicit = TokenizeRequest.model_validate({"prompt": "x", "add_special_tokens": False})
    assert explicit.add_special_tokens is False


# --- to_sampling_params -------------------------------------------------------------------------


def test_completion_maps_every_field_onto_sampling_params():
    request = CompletionRequest.model_validate(completion(
        n=2, best_of=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=7, stop="###", stop_token_ids=[3],
        ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=3, prompt_logprobs=1,
        skip_special_tokens=False, spaces_between_special_tokens=False,
        include_stop_str_in_output=True, logit_bias={"11": -100, "12": 5.5}))
    assert request.to_sampling_params() == SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=7, stop=["###"], stop_token_ids=[3],
        ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=3, prompt_logprobs=1,
        skip_special_tokens=False, spaces_between_special_tokens=False,
        include_stop_str_in_output=True, logit_bias={11: -100.0, 12: 5.5})


def test_completion_defaults_match_sampling_params_defaults():
    params = CompletionRequest(prompt="x").to_sampling_params()
    assert params == SamplingParams(max_tokens=16)


def test_null_max_tokens_is_left_to_the_engine():
    """(the engine's processor fills in what the context leaves: tests/engine/test_llm.py)"""
    request = CompletionRequest.model_validate(completion(max_tokens=None))
    assert request.to_sampling_params().max_tokens is None


def test_completion_echo_with_logprobs_asks_for_prompt_logprobs():
    request = CompletionRequest.model_validate(completion(echo=True, logprobs=2))
    assert request.to_sampling_params().prompt_logprobs == 2


@pytest.mark.parametrize("top_k", [None, 0, -1])
def test_top_k_none_zero_or_minus_one_disables(top_k):
    assert CompletionRequest(prompt="x", top_k=top_k).to_sampling_params().top_k == -1


@pytest.mark.parametrize("fields, expected", [
    ({"max_tokens": 5, "max_completion_tokens": 7}, 7),
    ({"max_tokens": 5}, 5),
    ({"max_completion_tokens": 7}, 7),
    ({}, None),
])
def test_chat_max_completion_tokens_wins_over_max_tokens(fields, expected):
    request = ChatCompletionRequest.model_validate(chat(**fields))
    assert request.to_sampling_params().max_tokens == expected


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 5}, 5),
])
def test_chat_top_logprobs_become_sampling_logprobs(fields, expected):
    request = ChatCompletionRequest.model_validate(chat(**fields))
    assert request.to_sampling_params().logprobs == expected


def test_chat_maps_sampling_fields_like_completions():
    request = ChatCompletionRequest.model_validate(chat(
        temperature=0, seed=3, stop=["a", "b"], logit_bias={"7": 2}, n=3, top_k=0,
        ignore_eos=True, min_tokens=1, prompt_logprobs=0))
    assert request.to_sampling_params() == SamplingParams(
        temperature=0.0, seed=3, stop=["a", "b"], logit_bias={7: 2.0}, n=3, ignore_eos=True,
        min_tokens=1, prompt_logprobs=0, max_tokens=None)


@pytest.mark.parametrize("fields, name", [
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_sampling_params_rejections_surface_as_value_errors_naming_the_field(fields, name):
    request = CompletionRequest.model_validate(completion(**fields))
    with pytest.raises(ValueError, match=name) as info:
        request.to_sampling_params()
    error = ServerError.from_value_error(info.value)
    assert (error.status, error.param) == (400, name)


# --- responses, parsed by the openai SDK's types ------------------------------------------------


def steps() -> list[dict[int, Logprob]]:
    """Two sampled tokens as the engine reports them: the chosen token first, then the top-k."""
    return [
        {5: Logprob(-0.1, 1, "Hé"), 6: Logprob(-2.5, 2, "Ha")},
        {7: Logprob(-3.0, 3, " there"), 8: Logprob(-0.5, 1, " you"), 9: Logprob(-1.0, 2, "!")},
    ]


def test_completion_logprobs_follow_openai_layout():
    logprobs = completion_logprobs([5, 7], steps(), decode=str, initial_offset=10)
    assert logprobs.tokens == ["Hé", " there"]
    assert logprobs.token_logprobs == [-0.1, -3.0]
    assert logprobs.text_offset == [10, 12]
    assert logprobs.top_logprobs == [{"Hé": -0.1, "Ha": -2.5},
                                     {" you": -0.5, "!": -1.0, " there": -3.0}]
    assert list(logprobs.top_logprobs[1]) == [" you", "!", " there"]  # best first


def test_completion_logprobs_leave_a_gap_where_a_token_has_none():
    logprobs = completion_logprobs([4, 5], [None, steps()[0]], decode=lambda t: f"<{t}>")
    assert logprobs.tokens == ["<4>", "Hé"]
    assert logprobs.token_logprobs == [None, -0.1] and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == [0, 3]


def test_logprob_helpers_clamp_minus_infinity_and_decode_missing_text():
    step = {3: Logprob(-math.inf, 2, None), 4: Logprob(0.0, 1, None)}
    assert completion_logprobs([3], [step], decode=lambda t: f"t{t}").top_logprobs == [
        {"t4": 0.0, "t3": -9999.0}]
    entry = chat_logprobs([3], [step], decode=lambda t: f"t{t}", num_top_logprobs=1).content[0]
    assert (entry.token, entry.logprob) == ("t3", -9999.0)
    assert [t.token for t in entry.top_logprobs] == ["t4"]


def test_logprob_helpers_reject_mismatched_lengths():
    with pytest.raises(ValueError):
        completion_logprobs([1, 2], steps()[:1], decode=str)


def test_chat_logprobs_give_utf8_bytes_and_the_k_most_likely():
    logprobs = chat_logprobs([5, 7], steps(), decode=str, num_top_logprobs=2)
    first, second = logprobs.content
    assert (first.token, first.logprob, first.bytes) == ("Hé", -0.1, [72, 195, 169])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Hé", -0.1), ("Ha", -2.5)]
    assert [t.token for t in second.top_logprobs] == [" you", "!"]  # chosen (rank 3) not in top 2
    assert chat_logprobs([5], steps()[:1], str, num_top_logprobs=0).content[0].top_logprobs == []


def test_completion_response_parses_as_openai_completion():
    choice = CompletionChoice(index=0, text="Hé there", finish_reason="length",
                              logprobs=completion_logprobs([5, 7], steps(), decode=str))
    response = CompletionResponse(model="m", choices=[choice], usage=UsageInfo.of(3, 2))
    payload = json.loads(response.model_dump_json())
    parsed = Completion.model_validate(payload)
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.choices[0].logprobs.tokens == ["Hé", " there"]
    assert parsed.usage.total_tokens == 5
    assert set(payload["choices"][0]) >= {"index", "text", "logprobs", "finish_reason",
                                          "stop_reason"}


def test_completion_stream_chunk_parses_as_openai_completion():
    # Mid-stream chunks carry finish_reason null, which the SDK reads without validating (see
    # the round trip below); the last chunk validates strictly.
    chunk = CompletionStreamResponse(id="cmpl-1", created=1, model="m", choices=[
        CompletionChoice(index=1, text=" there", finish_reason="stop")])
    parsed = Completion.model_validate(json.loads(chunk.model_dump_json()))
    assert parsed.choices[0].text == " there" and parsed.choices[0].index == 1
    assert parsed.object == "text_completion"


def test_chat_response_parses_as_openai_chat_completion():
    choice = ChatCompletionChoice(
        index=0, message=ChatResponseMessage(content="Hé there"), finish_reason="stop",
        logprobs=chat_logprobs([5, 7], steps(), decode=str, num_top_logprobs=1))
    response = ChatCompletionResponse(model="m", choices=[choice], usage=UsageInfo.of(4, 2))
    parsed = ChatCompletion.model_validate(json.loads(response.model_dump_json()))
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hé there"
    assert parsed.choices[0].logprobs.content[1].top_logprobs[0].token == " you"
    assert parsed.usage.prompt_tokens == 4


def test_chat_stream_chunks_parse_and_deltas_carry_only_what_is_set():
    first = chat_role_chunk("chatcmpl-1", "m", created=1, index=0)
    middle = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=1, model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hi"))])
    last = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=1, model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")])
    usage = ChatCompletionStreamResponse(id="chatcmpl-1", created=1, model="m", choices=[],
                                         usage=UsageInfo.of(3, 1))
    dumped = [json.loads(c.model_dump_json()) for c in (first, middle, last, usage)]
    assert [d["choices"][0]["delta"] for d in dumped[:3]] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}, {}]
    parsed = [ChatCompletionChunk.model_validate(d) for d in dumped]
    assert all(p.object == "chat.completion.chunk" for p in parsed)
    assert parsed[2].choices[0].finish_reason == "stop" and parsed[3].usage.total_tokens == 4


def test_model_list_matches_v1_models():
    models = ModelList(data=[ModelCard(id="tiny", root="/models/tiny", max_model_len=256)])
    payload = models.model_dump()
    assert payload["object"] == "list"
    assert set(payload["data"][0]) == {"id", "object", "created", "owned_by", "root",
                                       "max_model_len", "quantization"}
    card = Model.model_validate(payload["data"][0])
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "aserve")


def test_tokenize_responses_have_the_documented_keys():
    assert TokenizeResponse(tokens=[1, 2], count=2, max_model_len=64).model_dump() == {
        "tokens": [1, 2], "count": 2, "max_model_len": 64}
    assert DetokenizeResponse(prompt="hi").model_dump() == {"prompt": "hi"}


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, kind", [
    (400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError"),
    (500, "InternalServerError"), (503, "ServiceUnavailableError"), (405, "MethodNotAllowedError"),
])
def test_error_type_names_the_status_like_the_sdk(status, kind):
    assert error_type(status) == kind


def test_error_response_body_is_exactly_openai_shaped():
    response = error_response("The model `x` does not exist.", 404, param="model")
    assert response.status_code == 404
    assert json.loads(response.body) == {"error": {
        "message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model",
        "code": 404}}
    assert ErrorResponse.model_validate_json(response.body).error.code == 404


def _sse(chunks) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _parse_completion(request: Request):
    parsed = CompletionRequest.model_validate_json(await request.body())
    if parsed.stream:
        return _sse(CompletionStreamResponse(id="cmpl-1", created=1, model="m", choices=[
            CompletionChoice(index=0, text=text, finish_reason=reason)])
            for text, reason in (("o", None), ("k", "stop")))
    return JSONResponse(CompletionResponse(
        model=parsed.model or "m", usage=UsageInfo.of(1, 1),
        choices=[CompletionChoice(index=0, text="ok", finish_reason="stop")]).model_dump())


async def _parse_chat(request: Request):
    parsed = ChatCompletionRequest.model_validate_json(await request.body())
    params = parsed.to_sampling_params()
    if parsed.stream:
        return _sse([chat_role_chunk("chatcmpl-1", "m", 1, 0), ChatCompletionStreamResponse(
            id="chatcmpl-1", created=1, model="m", choices=[ChatCompletionStreamChoice(
                index=0, delta=DeltaMessage(content="ok"), finish_reason="stop")])])
    return JSONResponse(ChatCompletionResponse(
        model="m", usage=UsageInfo.of(1, params.max_tokens or 32),
        choices=[ChatCompletionChoice(index=0, message=ChatResponseMessage(content="ok"),
                                      finish_reason="length")]).model_dump())


async def _raw_json(request: Request) -> JSONResponse:
    return JSONResponse(await request.json())


async def _not_found(request: Request) -> JSONResponse:
    raise ServerError("The model `x` does not exist.", 404, param="model")


async def _crash(request: Request) -> JSONResponse:
    raise RuntimeError("secret internals")


@pytest.fixture(scope="module")
def client():
    app = Starlette(routes=[
        Route("/v1/completions", _parse_completion, methods=["POST"]),
        Route("/v1/chat/completions", _parse_chat, methods=["POST"]),
        Route("/raw", _raw_json, methods=["POST"]),
        Route("/missing", _not_found),
        Route("/crash", _crash),
    ], exception_handlers=EXCEPTION_HANDLERS)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", b'{"prompt": "x", "n": 0}', 400),
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/raw", b"{not json", 400),
    ("POST", "/raw", b"\xff\xfe", 400),
    ("GET", "/missing", None, 404),
    ("GET", "/no/such/route", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("GET", "/crash", None, 500),
])
def test_handlers_answer_every_failure_in_the_error_shape(client, method, path, body, status):
    response = client.request(method, path, content=body)
    assert response.status_code == status
    payload = response.json()
    assert set(payload) == {"error"} and set(payload["error"]) == ERROR_KEYS
    assert payload["error"]["code"] == status and payload["error"]["type"] == error_type(status)
    assert "Traceback" not in response.text


def test_openai_sdk_round_trip_through_the_protocol(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)
    done = sdk.completions.create(model="m", prompt="hi", max_tokens=3, logprobs=2,
                                  extra_body={"top_k": 5, "unknown": 1})
    assert done.choices[0].text == "ok"
    pieces = list(sdk.completions.create(model="m", prompt="hi", stream=True))
    assert [(p.choices[0].text, p.choices[0].finish_reason) for p in pieces] == [
        ("o", None), ("k", "stop")]
    reply = sdk.chat.completions.create(model="m", messages=USER, max_completion_tokens=4)
    assert reply.choices[0].message.content == "ok" and reply.usage.completion_tokens == 4
    chunks = list(sdk.chat.completions.create(model="m", messages=USER, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ok"


def test_openai_sdk_raises_bad_request_with_our_param(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="m", prompt="hi", n=0)
    assert info.value.status_code == 400 and info.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="suffix is not currently supported"):
        sdk.completions.create(model="m", prompt="hi", suffix="!")
