"""The Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel`.

A response is a chat completion underneath (`responses_items.py` turns the request into one,
`chat.start_chat` runs it), so tools, tool parsers, JSON schemas and reasoning parsers work as
they do for chat. What differs is the shape of what comes back: output items — `reasoning`
(the reasoning parser's text), `message` (its `output_text`), `function_call` — and, streamed,
OpenAI's typed events (`responses_events.py`), each sent as `event: <type>` + `data: {...}`.

Stored responses (`responses_store.py`) keep their conversation for `previous_response_id`.
A background response (`background: true`) is answered in progress at once and polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.server.chat import ChatView, render_chat, start_chat
from aserve.server.errors import ServerError
from aserve.server.protocol import ChatCompletionRequest
from aserve.server.responses_events import (
    ID_PREFIXES,
    StreamEvents,
    new_id,
    reply_items,
    reply_messages,
)
from aserve.server.responses_items import ResponsesRequest, as_responses_error, input_messages
from aserve.server.responses_store import StoredResponse
from aserve.server.serving import (
    EventStream,
    Generation,
    check_model,
    collect_or_abort,
    merged_outputs,
    parse_body,
    running_engine,
    server_state,
)

# No tokenizer's token is this long on natural text (~4 characters a token): a conversation's
# tail longer than this many characters a token of the room is not rendered to find it too long
MAX_CHARS_PER_TOKEN = 32


async def create_response(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    check_model(request, body.model)
    state = server_state(request)
    if body.background and state.config.max_stored_responses == 0:
        raise ServerError("background: this server stores no responses "
                          "(--max-stored-responses 0), so none could be polled.", 400,
                          "background")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            raise ServerError(f"Response with id '{body.previous_response_id}' not found: it "
                              "was not stored (store: false), was deleted, or was evicted.",
                              404, "previous_response_id")
        history = stored.messages
    items = [{"id": new_id(ID_PREFIXES[item["type"]]), **item} if "id" not in item else item
             for item in body.input_items()]
    messages = input_messages(items)
    response_id = new_id("resp")
    try:
        chat = await _fitted_chat(request, body, history, messages)
        view, generations = await start_chat(request, chat, response_id)
    except ServerError as e:
        raise as_responses_error(e) from e
    reply = ResponseView(body, state.model_name, response_id, view, history + messages, items)
    if body.background:
        return JSONResponse(reply.start_in_background(state, generations))
    if body.stream:
        return EventStream(reply.events(request, generations), generations,
                           state.config.stream_stall_timeout)
    results = await collect_or_abort(request, generations)
    response = reply.finish(view.response(generations[0], results[0]))
    reply.store(state, response)
    return JSONResponse(response)


async def _fitted_chat(request: Request, body: ResponsesRequest, history: list[dict],
                       messages: list[dict]) -> ChatCompletionRequest:
    """The chat request; with `truncation: auto`, the oldest turns of the conversation dropped
    (whole: the kept part starts at a user message) until the prompt leaves max_output_tokens
    (or one token) in the context. Starts whose text is over MAX_CHARS_PER_TOKEN characters a
    token of that room are passed over unrendered, and the first start that fits is found by
    bisection among the rest, so a hostile conversation costs a few renders of at most a
    context's worth of text."""
    conversation = history + messages
    if body.truncation != "auto" or not conversation:  # (nothing to drop: an empty input
        return body.to_chat([], conversation)  # is the chat request's to refuse)
    engine = running_engine(request)
    room = engine.model_info.max_model_len - (body.max_output_tokens or 1)

    async def fits(start: int) -> bool:
        candidate = body.to_chat([], conversation[start:])
        text = await render_chat(request, engine, candidate)
        try:
            ids = await engine.encode(text, add_special_tokens=candidate.add_special_tokens)
        except ValueError:  # longer than any context
            return False
        return len(ids) <= room

    chars = [0] * (len(conversation) + 1)  # chars[k]: the text from message k on
    for k in range(len(conversation) - 1, -1, -1):
        chars[k] = chars[k + 1] + _num_chars(conversation[k])
    starts = [k for k, m in enumerate(conversation) if k == 0 or m["role"] == "user"]
    starts = [k for k in starts if chars[k] <= room * MAX_CHARS_PER_TOKEN] or starts[-1:]
    lo, hi = 0, len(starts) - 1  # the first start that fits is in starts[lo..hi], or none
    while lo < hi:
        mid = (lo + hi) // 2
        if await fits(starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return body.to_chat([], conversation[starts[lo]:])  # (too long still: a 400 naming input)


def _num_chars(message: dict[str, Any]) -> int:
    calls = message.get("tool_calls") or ()
    return len(message.get("content") or "") + sum(
        len(c["function"]["name"]) + len(c["function"]["arguments"]) for c in calls)


async def retrieve_response(request: Request) -> Response:
    return JSONResponse(_stored(request).response)


async def delete_response(request: Request) -> Response:
    """Forgets a stored response (one still running in the background is cancelled first)."""
    response_id = request.path_params["response_id"]
    await _cancel(request, response_id)
    if not server_state(request).responses.delete(response_id):
        _stored(request)  # the 404
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: a background response stops (its generation aborted)
    and is stored as cancelled; one that has finished is returned as it is."""
    response_id = request.path_params["response_id"]
    await _cancel(request, response_id)
    stored = _stored(request)
    if not stored.response.get("background"):
        raise ServerError("Only a background response can be cancelled.", 400, "response_id")
    return JSONResponse(stored.response)


async def _cancel(request: Request, response_id: str) -> None:
    task = server_state(request).background.get(response_id)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def list_input_items(request: Request) -> Response:
    """A stored response's input items, OpenAI's list page: `order` (desc by default),
    `limit` (1-100, 20), `after` (an item id)."""
    items = _stored(request).input_items
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ServerError("order must be asc or desc.", 400, "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ServerError("limit must be an integer from 1 to 100.", 400, "limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ServerError(f"No input item with id '{after}'.", 404, "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(ordered) > limit})


def _stored(request: Request) -> StoredResponse:
    response_id = request.path_params["response_id"]
    stored = server_state(request).responses.get(response_id)
    if stored is None:
        raise ServerError(f"Response with id '{response_id}' not found.", 404, "response_id")
    return stored


class ResponseView:
    """One request's Response object: whole (`finish`), or as typed stream events (`events`),
    and stored after (`store`)."""

    def __init__(self, body: ResponsesRequest, model: str, response_id: str, chat: ChatView,
                 conversation: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
        self.body, self.model, self.id, self.chat = body, model, response_id, chat
        self.conversation, self.items = conversation, items
        self.created_at = int(time.time())

    def skeleton(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: bool = False, error: dict | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": bool(body.background), "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
            "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": (body.tool_choice.model_dump()
                            if hasattr(body.tool_choice, "model_dump")
                            else body.tool_choice or "auto"),
            "tools": [t.model_dump() for t in body.function_tools()],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "usage": usage, "user": None,
            "metadata": body.metadata or {},
        }

    def usage(self, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.chat.num_cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + output_tokens}

    def finish(self, chat) -> dict[str, Any]:
        """The whole response of a chat completion's one choice."""
        choice = chat.choices[0]
        incomplete = choice.finish_reason == "length"
        logprobs = ([lp.model_dump() for lp in choice.logprobs.content or []]
                    if choice.logprobs is not None else [])
        output = reply_items(choice.message, logprobs, "incomplete" if incomplete
                             else "completed")
        usage = self.usage(chat.usage.prompt_tokens, chat.usage.completion_tokens)
        return self.skeleton("incomplete" if incomplete else "completed", output, usage,
                             incomplete)

    def store(self, state, response: dict[str, Any]) -> None:
        """Kept for retrieval and continuation, unless `store: false`."""
        if self.body.store is not False:
            state.responses.put(StoredResponse(
                response, self.conversation + reply_messages(response["output"]), self.items))

    def start_in_background(self, state, generations: list[Generation]) -> dict[str, Any]:
        """`background: true`: the response, stored in progress, is answered at once; a task
        of the loop collects the generation and stores the result — completed, incomplete,
        failed, or cancelled (`cancel_response`). The client going away does not stop it;
        the engine's admission bounds how many run."""
        started = self.skeleton("in_progress", [])
        self.store(state, started)
        task = asyncio.create_task(self._finish_in_background(state, generations))
        state.background[self.id] = task
        task.add_done_callback(lambda _: state.background.pop(self.id, None))
        return started

    async def _finish_in_background(self, state, generations: list[Generation]) -> None:
        try:
            results: list[list] = [[] for _ in generations]
            async for i, output in merged_outputs(generations):
                results[i].append(output)
            response = self.finish(self.chat.response(generations[0], results[0]))
        except asyncio.CancelledError:  # (merged_outputs has aborted the generation)
            response = self.skeleton("cancelled", [])
        except Exception as e:  # noqa: BLE001 - the poller reads it in the stored response
            message = e.message if isinstance(e, ServerError) else str(e)
            response = self.skeleton("failed", [], error={"code": "server_error",
                                                          "message": message})
        self.store(state, response)

    async def events(self, request: Request, generations: list[Generation]
                     ) -> AsyncIterator[str]:
        """The stream's body: typed events, then the response stored."""
        events = StreamEvents(self)
        try:
            async for event in events.run(self.chat.stream(generations)):
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
        finally:
            if events.final is not None:
                self.store(server_state(request), events.final)
