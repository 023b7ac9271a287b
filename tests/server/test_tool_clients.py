"""Tool calls as the clients people use send them, against `python -m aserve` started with no
tool flags (the built-in demo model): the openai SDK's default tools request (no tool_choice)
and LangChain's `ChatOpenAI.bind_tools()` without tool_choice are answered, streamed and not;
with a named tool_choice LangChain reads a valid call (its `tool_calls`, never
`invalid_tool_calls`), streamed chunks adding up to the same call."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import jsonschema
import pytest
from helpers.server import free_port, wait_healthy

pytestmark = pytest.mark.spawns

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "aserve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout=120)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_openai_sdks_default_tools_request_is_answered(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.chat.completions.create(model="aserve-demo", max_tokens=16, tools=TOOLS,
                                         messages=[{"role": "user", "content": QUESTION}])
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    stream = client.chat.completions.create(model="aserve-demo", max_tokens=16, tools=TOOLS,
                                            messages=[{"role": "user", "content": QUESTION}],
                                            stream=True)
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] is not None


def langchain_model(url: str, **kwargs):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="aserve-demo", base_url=f"{url}/v1",
                                       api_key="none", max_tokens=24, **kwargs)


def test_langchain_bind_tools_without_tool_choice_is_answered(url):
    from langchain_core.messages import AIMessage

    model = langchain_model(url).bind_tools(TOOLS)
    reply = model.invoke(QUESTION)
    assert isinstance(reply, AIMessage) and not reply.invalid_tool_calls
    chunks = list(model.stream(QUESTION))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert not whole.invalid_tool_calls


def test_langchain_reads_a_named_call_streamed_or_not(url):
    model = langchain_model(url, temperature=1.0, seed=0).bind_tools(
        TOOLS, tool_choice="get_weather")
    reply = model.invoke(QUESTION)
    assert not reply.invalid_tool_calls
    [call] = reply.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)
    chunks = list(model.stream(QUESTION))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert not whole.invalid_tool_calls
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(call["name"], call["args"])]
