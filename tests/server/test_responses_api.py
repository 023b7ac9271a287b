"""The Responses API with the real openai SDK against a served tiny random-weight model:
a response's text equals the chat completion of the same conversation (instructions as the
system message), streamed or not; the typed events come in OpenAI's order with consecutive
sequence numbers and validate against the SDK's event types (reasoning, text and calls, from
a recorded chat stream too); function tools give calls that validate, and continuing with
`previous_response_id` and a `function_call_output` generates what chat does from the same
history; a JSON schema format holds; stored responses are retrieved, listed, deleted, and
`store: false` keeps nothing; `truncation: auto` drops the oldest turns; bad requests are 400 /
404 naming the field; the store stays within its bounds.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers.server import assert_error, serving, tiny_app
from openai._models import validate_type
from openai.types.responses import Response

from aserve.server import ServerConfig
from aserve.server.responses import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from aserve.server.responses_events import StreamEvents, reply_items, reply_messages
from aserve.server.responses_store import ResponseStore, StoredResponse
from aserve.server.tools import FunctionCall, ToolCall

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
GREEDY = dict(model="tiny", temperature=0.0)


@pytest.fixture(scope="module")
def url(llama_dir):
    config = ServerConfig(served_model_name="tiny", tool_call_parser="hermes")
    with serving(tiny_app(llama_dir, config, max_model_len=128)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none")


def chat_text(client, messages, max_tokens) -> str:
    reply = client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)
    return reply.choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    response = client.responses.create(input="Hello there", instructions="Be brief.",
                                       max_output_tokens=8, **GREEDY)
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello there"}], 8)
    assert response.output_text == expected and expected
    assert response.object == "response" and response.id.startswith("resp_")
    # the random model does not stop within 8 tokens: cut off by max_output_tokens
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 0
    assert [item.type for item in response.output] == ["message"]


def test_streamed_events_come_in_order_and_add_up_to_the_response(client):
    kwargs = dict(input=[{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                  max_output_tokens=6, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 6
    assert final.id == events[0].response.id != whole.id
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored


def test_a_function_tool_call_and_its_continuation(client):
    response = client.responses.create(input="Weather in Paris?", tools=[TOOL],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=60, **GREEDY)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(
        previous_response_id=response.id, max_output_tokens=6, **GREEDY,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"}
               for c in calls])
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.call_id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
               *({"role": "tool", "tool_call_id": c.call_id, "content": "Sunny"}
                 for c in calls)]
    assert follow.output_text == chat_text(client, history, 6)
    assert follow.previous_response_id == response.id


def test_streamed_calls_and_a_json_schema_through_the_sdk_stream_helper(client, llama_dir):
    from aserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(llama_dir)  # nudged to close the array of calls
    closing = {str(tokenizer.token_to_id(c)): 4.0 for c in ('"', "]")}
    events = list(client.responses.create(input="Weather?", tools=[TOOL], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=60,
                                          stream=True, extra_body={"logit_bias": closing},
                                          **GREEDY))
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == arguments
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    with client.responses.stream(input="Weather?", text=fmt, max_output_tokens=60,
                                 **GREEDY) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), WEATHER)
    assert final.text.format.type == "json_schema"


def test_stored_responses_are_retrieved_listed_and_deleted(client):
    response = client.responses.create(input=[{"role": "user", "content": "One"},
                                              {"role": "assistant", "content": "Two"},
                                              {"role": "user", "content": "Three"}],
                                       max_output_tokens=3, metadata={"k": "v"}, **GREEDY)
    again = client.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.metadata == {"k": "v"}
    items = list(client.responses.input_items.list(response.id, order="asc"))
    assert [item.content[0].text for item in items] == ["One", "Two", "Three"]
    assert len(list(client.responses.input_items.list(response.id, limit=2))) == 3  # pages
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(input="x", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(input="x", previous_response_id=unstored.id, **GREEDY)
    assert error.value.body["param"] == "previous_response_id"


def test_background_responses_are_polled_and_cancelled(client):
    import time

    kwargs = dict(input="Tell me", max_output_tokens=5, **GREEDY)
    started = client.responses.create(**kwargs, background=True)
    assert started.status == "in_progress" and started.background
    deadline = time.monotonic() + 30
    while (polled := client.responses.retrieve(started.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status == "incomplete"
    assert polled.output_text == client.responses.create(**kwargs).output_text
    long = client.responses.create(input="Go on", max_output_tokens=100, background=True,
                                   extra_body={"ignore_eos": True}, **GREEDY)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(client.responses.create(**kwargs).id)


def test_truncation_auto_drops_the_oldest_turns(url):
    turn = "word " * 40
    conversation = [{"role": role, "content": turn} for role in ["user", "assistant"] * 3]
    conversation.append({"role": "user", "content": "last"})
    body = {"model": "tiny", "input": conversation, "max_output_tokens": 4, "temperature": 0}
    assert_error(httpx.post(f"{url}/v1/responses", json=body), 400, "input")
    reply = httpx.post(f"{url}/v1/responses", json={**body, "truncation": "auto"}).json()
    assert reply["status"] == "incomplete" and reply["usage"]["input_tokens"] <= 124
    validate_type(type_=Response, value=reply)  # every field the SDK's type requires


def test_truncation_auto_renders_no_more_than_a_context_of_a_huge_conversation(url,
                                                                                 monkeypatch):
    """A hostile conversation (5 MB in 100 turns) with truncation auto: the turns too long to
    fit are passed over unrendered, so what is rendered stays near one context's worth."""
    from aserve.server import responses_api

    rendered: list[int] = []
    render = responses_api.render_chat

    async def counting(request, engine, body):
        text = await render(request, engine, body)
        rendered.append(len(text))
        return text

    monkeypatch.setattr(responses_api, "render_chat", counting)
    huge = [{"role": role, "content": "word " * 10_000} for role in ["user", "assistant"] * 50]
    body = {"model": "tiny", "input": [*huge, {"role": "user", "content": "last"}],
            "max_output_tokens": 4, "temperature": 0, "truncation": "auto"}
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    assert reply["status"] == "incomplete" and reply["usage"]["input_tokens"] <= 124
    assert sum(rendered) < 10_000, rendered  # (without the bound: megabytes, several times)


@pytest.mark.parametrize("body,status,param,contains", [
    ({"input": [{"type": "computer_call", "id": "x"}]}, 400, "input", "unknown input item"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, "input", "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input", "role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
    ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools", "tools.0.name"),
    ({"input": "x", "background": True, "stream": True}, 400, None, "background"),
    ({"input": "x", "background": True, "store": False}, 400, None, "background"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", ""),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400,
     "text.format", "schema"),
    ({"input": "x", "tool_choice": "required"}, 400, None, "tool_choice needs tools"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id",
     "not found"),
    ({"input": "word " * 400}, 400, "input", ""),
    ({"input": "x", "model": "other"}, 404, "model", ""),
    ({"input": []}, 400, "input", ""),
    ({"input": [], "truncation": "auto"}, 400, "input", ""),  # (nothing to truncate)
    ({"input": "x", "tools": True}, 400, "tools", ""),
])
def test_bad_requests_are_errors_naming_the_field(url, body, status, param, contains):
    assert_error(httpx.post(f"{url}/v1/responses", json=body), status, param, contains)


def test_unknown_stored_ids_are_404s(url):
    for method in ("GET", "DELETE"):
        assert_error(httpx.request(method, f"{url}/v1/responses/resp_nope"), 404,
                     "response_id", "not found")


def _chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id="c", model="tiny", choices=[
        ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=finish)])


async def _recorded_chat_stream():
    yield _chunk(DeltaMessage(role="assistant"))
    yield _chunk(DeltaMessage(reasoning_content="Let me "))
    yield _chunk(DeltaMessage(reasoning_content="think."))
    yield _chunk(DeltaMessage(content="Calling."))
    yield _chunk(DeltaMessage(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]),
                 "tool_calls")
    yield ChatCompletionStreamResponse(id="c", model="tiny", choices=[],
                                       usage=UsageInfo.of(5, 7))


def test_a_recorded_chat_stream_becomes_events_the_sdk_validates_and_accumulates():
    import asyncio

    from openai._models import validate_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from aserve.server.responses_api import ResponseView
    from aserve.server.responses_items import ResponsesRequest

    class Chat:
        num_cached_tokens = 0

    view = ResponseView(ResponsesRequest(input="q"), "tiny", "resp_1", Chat(), [], [])

    async def collect():
        return [e async for e in StreamEvents(view).run(_recorded_chat_stream())]

    events = asyncio.run(collect())
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        state.handle_event(validate_type(type_=ResponseStreamEvent, value=event))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message",
                                                          "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me think."
    assert final["output"][2]["call_id"] == "call_1"
    assert final["usage"]["total_tokens"] == 12 and events[-1]["type"] == "response.completed"
    # the same reply whole (a chat completion's message) gives the same items
    message = ChatResponseMessage(content="Calling.", reasoning_content="Let me think.",
                                  tool_calls=[ToolCall(id="call_1", function=FunctionCall(
                                      name="f", arguments="{}"))])
    whole = reply_items(message, [], "completed")

    def shape(items):
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    assert shape(whole) == shape(final["output"])
    assert reply_messages(whole) == [{"role": "assistant", "content": "Calling.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_the_store_keeps_within_its_count_and_bytes():
    store = ResponseStore(max_entries=3, max_bytes=2000)

    def entry(i: int, size: int = 10) -> StoredResponse:
        return StoredResponse({"id": f"r{i}"}, [{"role": "user", "content": "x" * size}], [])

    for i in range(5):
        assert store.put(entry(i))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # now the most recently used
    assert store.put(entry(5, 1500))
    assert store.num_bytes <= 2000 and store.get("r2") is not None
    assert not store.put(entry(6, 5000)) and store.get("r6") is None
    assert store.delete("r2") and not store.delete("r2")
    assert len(store) == 2 and store.num_bytes == sum(store.get(k).num_bytes
                                                       for k in ("r4", "r5"))
