"""Tool calling with the real openai SDK against a served tiny random-weight model at
temperature 1: `required` and named tool choices, streamed and not, give `tool_calls` whose
arguments validate against the function's schema, with `finish_reason: "tool_calls"`, each
streamed call whole once complete, equal to the non-streamed reply's; `auto` is the default
with tools on a server started with no tool flags, its parser chosen from the chat template,
and its calls constrained from the format's trigger on, so every call parses and validates; a
call cut off by max_tokens comes back as content with finish_reason "length", streamed or
not; no stream chunk is empty; tool history with any kind of arguments renders or is a 400;
the parsers read recorded model-format strings whole and streamed in random splits; bad tool
requests are 400s.
"""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest
from helpers.server import assert_error, serving, tiny_app

from aserve.server import ServerConfig
from aserve.server.protocol import ChatCompletionRequest
from aserve.server.tool_parsers import StreamingToolParser, get_tool_parser, tool_calls_of
from aserve.server.tool_replies import ChoiceToolStream, ReplyTools

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(llama_dir):
    config = ServerConfig(served_model_name="tiny", enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    with serving(tiny_app(llama_dir, config)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none")


@pytest.fixture(scope="module")
def closing_bias(llama_dir) -> dict[str, float]:
    """The random model is nudged to close its strings and the `required` array (which may
    hold any number of calls) instead of writing on until max_tokens."""
    from aserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(llama_dir)
    return {str(tokenizer.token_to_id(c)): 4.0 for c in ('"', "]")}


def assert_valid_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    """Tool-call deltas joined per index (id, name, concatenated arguments), and the finish
    reason of the stream."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] = delta.function.name or call["name"]
                    call["arguments"] += delta.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"])
def test_required_and_named_tool_choices_give_valid_calls_streamed_or_not(client, tool_choice,
                                                                          closing_bias):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  temperature=1.0, seed=11, max_tokens=200, logit_bias=closing_bias)
    out = client.chat.completions.create(**kwargs, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls, finish = streamed_calls(iter(chunks))
    assert finish == "tool_calls"
    deltas = [d for c in chunks for choice in c.choices for d in choice.delta.tool_calls or []]
    assert len(deltas) == len(calls)  # each call whole, once complete: never cut-off arguments
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] for c in calls.values())


def test_parallel_tool_calls_false_gives_one_call(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=1.0, seed=3, max_tokens=150, n=4)
    assert all(len(c.message.tool_calls) == 1 for c in out.choices)


HERMES_TEXT = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'  # noqa: E501


def test_auto_with_the_hermes_parser_turns_a_tool_call_block_into_calls(client):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                  temperature=1.0, seed=5, max_tokens=200,
                  extra_body={"structured_outputs": {"regex": r"Sure\. " + HERMES_TEXT}})
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert_valid_calls(choice.message.tool_calls, ["get_weather"])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls, finish = streamed_calls(iter(chunks))
    assert finish == "tool_calls" and content == choice.message.content  # as written
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_tool_history_is_accepted_and_reaches_the_template(client, llama_dir):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    from aserve.engine.tokenizer import Tokenizer

    body = ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
    template = ("{{ tools[0].function.name }}|"
                "{{ messages[1].tool_calls[0].function.arguments.city }}|"
                "{{ messages[2].tool_call_id }}")
    text = Tokenizer.from_dir(llama_dir).apply_chat_template(
        body.template_messages(), chat_template=template, tools=body.template_tools())
    assert text == "get_weather|Paris|call_1"


@pytest.mark.parametrize("body, contains", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_400s(url, body, contains):
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert_error(response, 400, contains=contains)


def test_tools_without_tool_choice_work_on_a_server_with_no_tool_flags(llama_dir):
    """What LangChain's bind_tools() and the openai SDK send by default (tools, no tool_choice,
    or "auto"): answered on a server started with no tool flags."""
    from openai import OpenAI

    with serving(tiny_app(llama_dir)) as base:
        for choice in ({}, {"tool_choice": "auto"}):
            response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5,
                **choice})
            assert response.status_code == 200, response.text
        out = OpenAI(base_url=f"{base}/v1", api_key="none").chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=5)
        assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


RECORDED = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Rome", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {"zone": "CET"}}\n</tool_call>',
               "Let me check.", [("get_weather", {"city": "Rome", "days": 3}),
                                 ("get_time", {"zone": "CET"})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", '
                    '"days": 1}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
                    "", [("get_weather", {"city": "Oslo", "days": 1}),
                         ("get_time", {"zone": "UTC"})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 7}}]', "", [("get_weather", {"city": "Paris", "days": 7})]),
    "mistral-v11": ('[TOOL_CALLS]get_time[ARGS]{"zone": "PST"}', "",
                    [("get_time", {"zone": "PST"})]),
}


@pytest.mark.parametrize("name", list(RECORDED))
def test_parsers_read_recorded_model_text_whole_and_in_random_splits(name):
    text, content, expected = RECORDED[name]
    parser = get_tool_parser(name.split("-")[0])
    parsed = parser.parse(text, final=True)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls_of(parsed)]
    assert calls == expected and parsed.content.strip() == content
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = StreamingToolParser(parser)
        got_content, got_calls = "", []
        for i, piece in enumerate(pieces):
            delta, new = stream.feed(piece, final=i == len(pieces) - 1)
            got_content += delta
            got_calls += new
        assert got_content.strip() == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == \
            expected


def test_text_without_a_call_stays_content():
    for name in ("hermes", "llama3_json", "mistral"):
        parsed = get_tool_parser(name).parse("Just words, <tool_call>{broken", final=True)
        assert parsed.calls == [] and parsed.content == "Just words, <tool_call>{broken"


REQUIRED_REPLIES = [
    '[{"name":"get_weather","parameters":{"city":"Par{is]\\"x","days":3}}]',
    '[{"name":"get_time","parameters":{"zone":"UTC"}},{"name":"get_weather","parameters":'
    '{"city":"","days":7,"extra":[{"a":[1,2]},null,true]}}]',
    ' [ { "parameters" : { "zone" : "a,b:c" } , "name" : "get_time" } ,\n'
    ' {"name": "get_weather", "parameters": {"city": "x", "days": 1}} ] ',
]


@pytest.mark.parametrize("reply", REQUIRED_REPLIES)
def test_required_replies_stream_names_then_arguments_in_random_splits(reply):
    """A `required` reply is the grammar's JSON array (compact, or with any whitespace): in
    any split its stream sends each call whole once its object closes, as the non-streamed
    reply has it: its arguments are the raw "parameters" text, which parses to the value in
    the reply."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 tool_choice="required")
    tools = ReplyTools(body, None)
    content, whole = tools.split(reply, "stop")
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == [
        (c["name"], c["parameters"]) for c in json.loads(reply)]
    rng = random.Random(reply)
    for _ in range(20):
        stream, cuts = ChoiceToolStream(tools), sorted(rng.sample(range(len(reply)), 6))
        calls: dict[int, dict] = {}
        for a, b in zip([0, *cuts], [*cuts, len(reply)]):
            _, deltas = stream.feed(reply[a:b], "stop" if b == len(reply) else None)
            for delta in deltas or []:
                call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
                if "id" in delta:
                    assert call["name"] is None and delta["function"]["name"]
                    call["name"] = delta["function"]["name"]
                call["arguments"] += delta["function"]["arguments"]
        assert stream.has_calls
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole]


# ------------------------------------------------------------------ constrained auto calls

@pytest.fixture(scope="module")
def tool_url(tmp_path_factory):
    """A tiny Qwen2 with Qwen's "<tool_call>" token and a template that renders tools as
    Qwen2.5's does, served with no tool flags: the hermes format is found in its template."""
    from helpers.hf_models import make_tool_model

    model = make_tool_model(tmp_path_factory.mktemp("tool_model") / "qwen2-tools")
    with serving(tiny_app(model, max_model_len=1024)) as base:
        yield base


def auto_request(url: str, **extra) -> dict:
    """Forced to start calls: "<tool_call>" (id 3) is 30 logits up wherever free text may go
    (inside a call the grammar decides), so each choice writes call after call until
    max_tokens; the calls that complete must all parse and validate."""
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0,
            "max_tokens": 120, "logit_bias": {"3": 30}, **extra}
    return body


@pytest.fixture(scope="module")
def coder_url(tmp_path_factory):
    """The same model read as Qwen3-Coder's XML calls (`--tool-call-parser qwen3_coder`),
    which are held by a Lark grammar rather than a JSON schema."""
    from helpers.hf_models import make_tool_model

    model = make_tool_model(tmp_path_factory.mktemp("tool_model") / "qwen2-tools")
    config = ServerConfig(served_model_name="tiny", tool_call_parser="qwen3_coder")
    with serving(tiny_app(model, config, max_model_len=1024)) as base:
        yield base


@pytest.mark.parametrize("server", ["tool_url", "coder_url"], ids=["hermes", "qwen3_coder"])
def test_auto_calls_are_constrained_from_the_trigger_on(server, request):
    tool_url = request.getfixturevalue(server)
    response = httpx.post(f"{tool_url}/v1/chat/completions", timeout=120,
                          json=auto_request(tool_url, n=8, seed=1))
    assert response.status_code == 200, response.text
    num_calls = 0
    for choice in response.json()["choices"]:
        calls = choice["message"]["tool_calls"]
        for call in calls:  # 100 %: every call the model completed parses and validates
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])
        num_calls += len(calls)
        # cut off by max_tokens inside the next call: that one is content, never a call
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].lstrip().startswith("<tool_call>")
    assert num_calls >= 8


@pytest.mark.parametrize("server", ["tool_url", "coder_url"], ids=["hermes", "qwen3_coder"])
def test_constrained_auto_calls_stream_as_they_come_whole(server, request):
    tool_url = request.getfixturevalue(server)
    body = auto_request(tool_url, seed=7)
    whole = httpx.post(f"{tool_url}/v1/chat/completions", json=body, timeout=120).json()
    message = whole["choices"][0]["message"]
    with httpx.stream("POST", f"{tool_url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]]
    assert all(d.get("content") or d.get("tool_calls") for d in deltas[:-1])  # none empty
    streamed = [t for d in deltas for t in d.get("tool_calls") or []]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in streamed] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_parallel_tool_calls_false_keeps_an_auto_replys_first_call(tool_url):
    body = auto_request(tool_url, seed=1, parallel_tool_calls=False)
    many = httpx.post(f"{tool_url}/v1/chat/completions", timeout=120,
                      json={**body, "parallel_tool_calls": True}).json()
    first = many["choices"][0]["message"]["tool_calls"]
    assert len(first) > 1  # (the model writes several calls)
    one = httpx.post(f"{tool_url}/v1/chat/completions", json=body, timeout=120).json()
    assert one["choices"][0]["message"]["tool_calls"] == [
        {**first[0], "id": one["choices"][0]["message"]["tool_calls"][0]["id"]}]
    with httpx.stream("POST", f"{tool_url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    streamed = [t for c in chunks if c["choices"]
                for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [t["function"] for t in streamed] == [first[0]["function"]]


# ------------------------------------------------------------------ one truncation rule

@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"])
def test_a_call_cut_off_is_content_with_length_streamed_or_not(url, tool_choice):
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
            "temperature": 1.0, "seed": 3, "max_tokens": 6}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"]  # the cut-off call's text
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks[1:] if c["choices"]]
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == \
        choice["message"]["content"]
    assert deltas[-1]["finish_reason"] == "length"
    assert all(d["delta"] or d["finish_reason"] for d in deltas)  # no empty chunk


# ------------------------------------------------------------------ history and bad tools

@pytest.mark.parametrize("arguments", [
    '{"city": "Paris", "days": 2}', {"city": "Paris", "days": 2}, '{"city": "Par', "", "[1]"])
def test_tool_history_with_any_arguments_renders_or_is_a_400(tool_url, arguments):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = httpx.post(f"{tool_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": history, "tools": TOOLS, "max_tokens": 3})
    if response.status_code != 200:
        assert_error(response, 400, "messages")


def test_a_tool_schema_that_cannot_compile_is_a_400_naming_tools(tool_url):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]
    for choice in ("auto", "required"):
        response = httpx.post(f"{tool_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MESSAGES, "tools": bad, "tool_choice": choice,
            "max_tokens": 3})
        assert_error(response, 400, "tools")


def test_demo_model_auto_calls_parse_and_validate_at_temperature_1():
    """The built-in demo model under the auto grammar, sampling at temperature 1. It never
    writes a call by itself (its template shows no tools), and its tokenizer spells Hermes'
    "<tool_call>" in 7 text tokens: the lazy-trigger path, where the grammar takes hold once
    the trigger's text is complete. So the trigger is written for it, after which it samples
    under the grammar's mask until the call closes; every call, read back by the hermes
    parser the server picks for it, parses and validates."""
    import llguidance
    import llguidance.torch
    import torch
    import transformers

    from aserve.assets import DEMO_MODEL_DIR
    from aserve.structured_output.constraints import compile_job, constraint_job

    body = ChatCompletionRequest(model="demo", messages=MESSAGES, tools=TOOLS)
    parser = get_tool_parser("hermes")
    spec = body.tool_constraint(parser.call_patterns(body.template_tools()))
    hf_tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR,
                                                              dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    tokenizer = llguidance.LLTokenizer(hf_tok.backend_tokenizer.to_str(), n_vocab=vocab,
                                       eos_token=[hf_tok.eos_token_id])
    compiled = compile_job(constraint_job(spec), tokenizer, llguidance.LLParserLimits())
    assert "grammar" in compiled, compiled
    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = hf_tok(prompt, add_special_tokens=False)["input_ids"]
    written = hf_tok("Let me see.\n<tool_call>", add_special_tokens=False)["input_ids"]
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    calls = []
    for seed in range(12):
        matcher = llguidance.LLMatcher(tokenizer, compiled["grammar"])
        assert all(matcher.consume_token(t) for t in written)  # free text, then the trigger
        generator = torch.Generator().manual_seed(seed)
        ids, past = torch.tensor([prompt_ids + written]), None
        out: list[int] = []
        with torch.no_grad():
            while "</tool_call>" not in hf_tok.decode(out) and len(out) < 200:
                step = model(input_ids=ids, past_key_values=past, use_cache=True)
                past, logits = step.past_key_values, step.logits[:, -1].float()
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
                assert matcher.consume_token(token), matcher.get_error()
                out.append(token)
                ids = torch.tensor([[token]])
        text = hf_tok.decode(written + out)
        assert "</tool_call>" in text  # the grammar closes every call it opens
        parsed = parser.parse(text, final=True)
        assert parsed.content == "Let me see.\n" and len(parsed.calls) == 1, text
        calls.append(parsed.calls[0])
    for name, arguments in calls:  # 100 %
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert len({name for name, _ in calls}) == 2  # both tools were called


def test_a_parser_that_does_not_exist_is_refused_when_the_app_is_built(llama_dir):
    from aserve.engine.arg_utils import EngineArgs
    from aserve.server import build_app

    with pytest.raises(ValueError, match="tool call parser 'nope' is unknown"):
        build_app(EngineArgs(model=str(llama_dir)), ServerConfig(tool_call_parser="nope"))


def test_a_template_that_joins_arguments_as_text_gets_them_as_text(llama_dir):
    """DeepSeek-V3.1's official template writes `... + tool['function']['arguments'] + ...`:
    objects (what other templates index into) fail there, so it is rendered again with the
    arguments as the JSON text they came as."""
    from pathlib import Path

    template = (Path(__file__).parents[1] / "data" / "chat_templates" /
                "deepseek-v3.1.jinja").read_text()
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    config = ServerConfig(served_model_name="tiny", chat_template=template)
    with serving(tiny_app(llama_dir, config, max_model_len=512)) as base:
        tokens = httpx.post(f"{base}/tokenize", timeout=60,
                            json={"model": "tiny", "messages": history}).json()["tokens"]
        text = httpx.post(f"{base}/detokenize", timeout=60,
                          json={"model": "tiny", "tokens": tokens}).json()["prompt"]
        assert 'get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 2}' in text
        out = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": history, "tools": TOOLS, "max_tokens": 3})
        assert out.status_code == 200, out.text
