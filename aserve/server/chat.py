"""`POST /v1/chat/completions`: messages rendered by the chat template (jinja2's sandbox), then
generated like a completion; plain JSON or a stream of `chat.completion.chunk` deltas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.engine.chat_template import MAX_REQUEST_TEMPLATE_BYTES, describe_error
from aserve.engine.outputs import RequestOutput
from aserve.server.errors import ServerError
from aserve.server.protocol import (
    ChatCompletionRequest,
    make_id,
)
from aserve.server.reasoning_parsers import (
    END,
    ReasoningParser,
    StreamingReasoning,
    get_reasoning_parser,
    thinking_ended,
)
from aserve.server.responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    chat_logprobs,
    chat_role_chunk,
)
from aserve.server.serving import (
    Generation,
    check_model,
    collect_or_abort,
    event_stream,
    merged_outputs,
    parse_body,
    prepare,
    process_prompt,
    running_engine,
    sampling_params_of,
    server_state,
    start_generations,
)
from aserve.server.tool_parsers import ToolParser, get_tool_parser, parser_for_template
from aserve.server.tool_replies import ReplyTools


async def render_chat(request: Request, engine, body: ChatCompletionRequest | object) -> str:
    """The prompt text of a chat body, or a 400 before the engine sees it. A template the
    request brings (`chat_template`, or `chat_template_kwargs.chat_template` as vLLM reads it)
    is refused unless the server trusts them (`--trust-request-chat-template`); a trusted one is
    compiled and rendered in a worker thread, so the event loop keeps serving everyone else
    while it runs within its bounds (`aserve/engine/chat_template.py`)."""
    kwargs = dict(body.chat_template_kwargs or {})
    kwargs.pop("chat_template", None)
    own = own_template(body)
    if own is not None:
        _check_request_template(own, server_state(request).config, engine.tokenizer)
    template = own or server_state(request).chat_template

    def render() -> str:
        def attempt(arguments_as_text: bool) -> str:
            return engine.tokenizer.apply_chat_template(
                body.template_messages(arguments_as_text),
                add_generation_prompt=body.add_generation_prompt, chat_template=template,
                tools=getattr(body, "template_tools", lambda: None)(), **kwargs)

        try:
            return attempt(False)
        except TypeError:  # a template that joins tool-call arguments as text, not objects
            if not body.has_tool_history:
                raise
            return attempt(True)

    try:
        return await asyncio.to_thread(render) if own else render()
    except Exception as e:  # noqa: BLE001 - a template (maybe the request's own) failed on it
        raise ServerError(f"The chat template could not be applied: {describe_error(e)}",
                          400, "chat_template" if own else "messages") from e


def own_template(body) -> str | None:
    """The template a request brings: `chat_template`, else vLLM's
    `chat_template_kwargs.chat_template`."""
    own = getattr(body, "chat_template", None)
    return (body.chat_template_kwargs or {}).get("chat_template") if own is None else own


def _check_request_template(source: object, config, tokenizer) -> None:
    """A request's own template: the name of one of the model's (always allowed), or a
    template the server trusts, of at most MAX_REQUEST_TEMPLATE_BYTES."""
    if not isinstance(source, str):
        raise ServerError("chat_template must be a string.", 400, "chat_template")
    if isinstance(tokenizer.chat_template, dict) and source in tokenizer.chat_template:
        return
    if not config.trust_request_chat_template:
        raise ServerError("This server does not accept a chat template in the request; its "
                          "operator may allow them with --trust-request-chat-template.",
                          400, "chat_template")
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_REQUEST_TEMPLATE_BYTES:
        raise ServerError(f"chat_template is {size} bytes; at most "
                          f"{MAX_REQUEST_TEMPLATE_BYTES} are accepted.", 400, "chat_template")


async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    check_model(request, body.model)
    view, generations = await start_chat(request, body, make_id("chatcmpl"))
    if body.stream:
        return event_stream(request, view.stream(generations), generations)
    results = await collect_or_abort(request, generations)
    return JSONResponse(view.response(generations[0], results[0]).model_dump())


async def start_chat(request: Request, body: ChatCompletionRequest, request_id: str
                     ) -> tuple[ChatView, list[Generation]]:
    """A checked chat request rendered, prepared and handed to the engine (a 400 before the
    engine sees anything bad): the view that turns its outputs into replies, and its one
    generation. The chat route's, and the Responses API's (`responses_api.py`)."""
    state = server_state(request)
    reasoning = (get_reasoning_parser(state.config.reasoning_parser)
                 if state.config.reasoning_parser else None)
    engine = running_engine(request)
    text = await render_chat(request, engine, body)
    prompt = await process_prompt(engine, text, body.add_special_tokens, body.cache_salt,
                                  "messages")
    params = sampling_params_of(body)
    parser = tool_parser_for(request, engine, body)
    if parser is not None:
        params.structured_outputs = params.structured_outputs or body.tool_constraint(
            parser.call_patterns(body.template_tools()),
            state.engine_args.structured_outputs_any_whitespace)
        if not parser.skip_special_tokens:
            params.skip_special_tokens = False  # its markers are special tokens
    if reasoning is not None and params.structured_outputs is not None and not thinking_ended(
            text):  # the constraint applies to the answer, after the reasoning
        params.structured_outputs = replace(params.structured_outputs, start_after=END)
    prepared = await prepare_tools(engine, prompt, params, body)
    generations = start_generations(request, engine, request_id, [prepared])
    return ChatView(body, state.model_name, request_id, engine.tokenizer, parser,
                    reasoning), generations


def tool_parser_for(request: Request, engine, body: ChatCompletionRequest
                    ) -> ToolParser | None:
    """The parser of an auto reply's calls (None for other tool modes): `--tool-call-parser`,
    else the format the chat template in use renders tools with (`parser_for_template`)."""
    if body.tool_mode != "auto":
        return None
    name = server_state(request).config.tool_call_parser
    if name is None:
        try:
            source = engine.tokenizer.get_chat_template(
                own_template(body) or server_state(request).chat_template,
                body.template_tools())
        except ValueError:  # (no template: rendering failed already)
            source = None
        name = parser_for_template(source, engine.tokenizer)
    parser = get_tool_parser(name)
    parser.tools = body.template_tools()  # (qwen3_coder types its values by their schemas)
    return parser


async def prepare_tools(engine, prompt, params, body: ChatCompletionRequest):
    """`prepare`, a tool constraint that cannot be compiled (a tool's schema) blamed on
    `tools`, the field the client wrote it in."""
    try:
        return await prepare(engine, prompt, params, body, "messages")
    except ServerError as e:
        from_tools = body.tools and body.structured_outputs_params() is None
        if from_tools and (e.param or "").startswith("structured_outputs"):
            e.message = "tools" + e.message[len(e.param):] if e.message.startswith(
                e.param) else e.message
            e.param = "tools"
        raise


class ChatView:
    """Turns engine deltas into OpenAI's chat completion objects for one HTTP request."""

    def __init__(self, body: ChatCompletionRequest, model: str, request_id: str,
                 tokenizer, tool_parser: ToolParser | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.body, self.model, self.request_id = body, model, request_id
        self.tokenizer = tokenizer
        self.tools = ReplyTools(body, tool_parser)
        self.reasoning = reasoning
        self.n = body.n or 1
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache
        last = body.messages[-1]
        # `echo`: the reply continues the last message when that is the assistant's own.
        self.echo = last.text() if body.echo and last.role == "assistant" else ""

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs_of(self, token_ids, logprobs):
        if not self.body.logprobs:
            return None
        steps = logprobs or [None] * len(token_ids)
        return chat_logprobs(token_ids, steps, self.decode, self.body.top_logprobs or 0)

    def response(self, generation: Generation,
                 outputs: list[RequestOutput]) -> ChatCompletionResponse:
        texts, ids = [self.echo] * self.n, [[] for _ in range(self.n)]
        logprobs: list[list] = [[] for _ in range(self.n)]
        reasons: list[tuple] = [(None, None)] * self.n
        for output in outputs:
            for delta in output.outputs:
                k = delta.index
                texts[k] += delta.text
                ids[k] += delta.token_ids
                logprobs[k] += delta.logprobs or [None] * len(delta.token_ids)
                reasons[k] = (delta.finish_reason, delta.stop_reason)
        choices = []
        for k in range(self.n):
            thought = None
            if self.reasoning is not None:
                parsed = self.reasoning.parse(texts[k], final=True)
                thought, texts[k] = parsed.reasoning or None, parsed.content
            content, calls = self.tools.split(texts[k], reasons[k][0])
            finish = "tool_calls" if calls and reasons[k][0] == "stop" else reasons[k][0]
            choices.append(ChatCompletionChoice(
                index=k, message=ChatResponseMessage(content=content, tool_calls=calls,
                                                     reasoning_content=thought),
                logprobs=self.logprobs_of(ids[k], logprobs[k]), finish_reason=finish,
                stop_reason=reasons[k][1]))
        self.num_cached_tokens = outputs[-1].num_cached_tokens if outputs else 0
        prompt_logprobs = (outputs[0].prompt_logprobs
                           if self.body.prompt_logprobs is not None else None)
        usage = UsageInfo.of(len(generation.prompt.prompt_token_ids), sum(map(len, ids)))
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                      usage=usage, prompt_logprobs=prompt_logprobs,
                                      kv_transfer_params=outputs[-1].kv_transfer_params)

    async def stream(self, generations: list[Generation]
                     ) -> AsyncIterator[ChatCompletionStreamResponse]:
        created = ChatCompletionStreamResponse(model=self.model, choices=[]).created
        num_prompt = len(generations[0].prompt.prompt_token_ids)
        num_generated = 0
        for k in range(self.n):
            yield chat_role_chunk(self.request_id, self.model, created, k)
        echoed: set[int] = set()
        streams = [self.tools.stream() for _ in range(self.n)]
        thinking = [StreamingReasoning(self.reasoning) if self.reasoning else None
                    for _ in range(self.n)]
        async for _, output in merged_outputs(generations):
            self.num_cached_tokens = output.num_cached_tokens
            for delta in output.outputs:
                text = delta.text
                if delta.index not in echoed:
                    echoed.add(delta.index)
                    text = self.echo + text
                num_generated += len(delta.token_ids)
                usage = (UsageInfo.of(num_prompt, num_generated)
                         if self.body.continuous_usage_stats else None)
                thought = None
                if thinking[delta.index] is not None:
                    thought, text = thinking[delta.index].feed(
                        text, final=delta.finish_reason is not None)
                content, calls = streams[delta.index].feed(text, delta.finish_reason)
                finish = delta.finish_reason
                if finish == "stop" and streams[delta.index].has_calls:
                    finish = "tool_calls"
                logprobs = self.logprobs_of(delta.token_ids, delta.logprobs)
                if not (content or calls or thought or finish or logprobs):
                    continue  # nothing to say yet (a call or a marker still being written)
                choice = ChatCompletionStreamChoice(
                    index=delta.index, delta=DeltaMessage(content=content or None,
                                                          tool_calls=calls,
                                                          reasoning_content=thought or None),
                    logprobs=logprobs, finish_reason=finish, stop_reason=delta.stop_reason)
                yield ChatCompletionStreamResponse(
                    id=self.request_id, created=created, model=self.model,
                    choices=[choice], usage=usage)
        if self.body.include_usage:
            yield ChatCompletionStreamResponse(
                id=self.request_id, created=created, model=self.model, choices=[],
                usage=UsageInfo.of(num_prompt, num_generated))
