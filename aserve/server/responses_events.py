"""The Responses API's output: a reply's items whole (`reply_items`, and `reply_messages`, the
chat messages a continuation reads of them), or as OpenAI's typed stream events
(`StreamEvents`, from the chat stream's chunks), each with a `sequence_number`:

    response.created, response.in_progress
    per item:  response.output_item.added
               message:    content_part.added, output_text.delta…, output_text.done,
                           content_part.done
               reasoning:  content_part.added, reasoning_text.delta…, reasoning_text.done,
                           content_part.done
               call:       function_call_arguments.delta, function_call_arguments.done
               response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it; an `error` event
    and response.failed when the engine failed)

No I/O here: `responses_api.py` sends them.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aserve.server.errors import ServerError
from aserve.server.protocol import make_id
from aserve.server.responses import ChatCompletionStreamResponse, ChatResponseMessage

if TYPE_CHECKING:
    from aserve.server.responses_api import ResponseView

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
               "reasoning": "rs"}


def new_id(prefix: str) -> str:
    """An item's (or a response's) id: `msg_…`, `fc_…`, `resp_…`."""
    return f"{prefix}_{make_id('x')[2:]}"


def reply_items(message: ChatResponseMessage, logprobs: list[dict], status: str
                ) -> list[dict[str, Any]]:
    """A chat reply as output items: its reasoning, its text, its calls."""
    output: list[dict[str, Any]] = []
    if message.reasoning_content:
        output.append(_reasoning_item(new_id("rs"), message.reasoning_content, status))
    if message.content:
        output.append(_message_item(new_id("msg"), message.content, logprobs, status))
    for call in message.tool_calls:
        output.append(_call_item(new_id("fc"), call.id, call.function.name,
                                 call.function.arguments, "completed"))
    return output


def reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation sees (its reasoning
    left out, as `input_messages` leaves out reasoning items)."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls}
                                                               if calls else {})}]


def _text_part(text: str, logprobs: list[dict]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, logprobs: list[dict], status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status != "in_progress" else []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]
            if status != "in_progress" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class StreamEvents:
    """Chat stream chunks → the Responses API's typed events (module docstring). One item is
    open at a time: text after reasoning closes the reasoning, a call closes the text."""

    def __init__(self, view: ResponseView) -> None:
        self.view = view
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.open: dict[str, Any] | None = None  # the item being written
        self.text, self.logprobs = "", []
        self.final: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number - 1, **fields}

    async def run(self, chunks: AsyncIterator[ChatCompletionStreamResponse]
                  ) -> AsyncIterator[dict[str, Any]]:
        view = self.view
        started = view.skeleton("in_progress", [])
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        finish, usage = None, None
        try:
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for event in self.feed(choice):
                        yield event
                    finish = choice.finish_reason or finish
        except Exception as e:  # noqa: BLE001 - the status is sent: reported in the stream
            error = e if isinstance(e, ServerError) else ServerError(str(e), 500)
            yield self.event("error", code=str(error.status), message=error.message,
                             param=error.param)
            failed = view.skeleton("failed", self.output + self.close(final=False),
                                   error={"code": "server_error", "message": error.message})
            yield self.event("response.failed", response=failed)
            return
        for event in self.close():
            yield event
        incomplete = finish == "length"
        self.final = view.skeleton(
            "incomplete" if incomplete else "completed", self.output,
            view.usage(usage.prompt_tokens, usage.completion_tokens) if usage else None,
            incomplete)
        yield self.event("response.incomplete" if incomplete else "response.completed",
                         response=self.final)

    def feed(self, choice) -> list[dict[str, Any]]:
        delta, events = choice.delta, []
        if delta.reasoning_content:
            events += self.write("reasoning", delta.reasoning_content, [])
        if delta.content:
            logprobs = ([lp.model_dump() for lp in choice.logprobs.content or []]
                        if choice.logprobs is not None else [])
            events += self.write("message", delta.content, logprobs)
        for call in delta.tool_calls or ():
            events += self.close()
            function = call["function"]
            index = len(self.output)
            added = _call_item(new_id("fc"), call["id"], function["name"], "", "in_progress")
            done = {**added, "arguments": function["arguments"], "status": "completed"}
            events += [
                self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.function_call_arguments.delta", item_id=added["id"],
                           output_index=index, delta=function["arguments"]),
                self.event("response.function_call_arguments.done", item_id=added["id"],
                           output_index=index, name=function["name"],
                           arguments=function["arguments"]),
                self.event("response.output_item.done", output_index=index, item=done)]
            self.output.append(done)
        return events

    def write(self, kind: str, text: str, logprobs: list[dict]) -> list[dict[str, Any]]:
        """`text` added to the open item of `kind` (opened first, closing another)."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            index = len(self.output)
            if kind == "message":
                self.open, part = _message_item(new_id("msg"), "", [], "in_progress"), \
                    _text_part("", [])
            else:
                self.open = _reasoning_item(new_id("rs"), "", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            events += [
                self.event("response.output_item.added", output_index=index,
                           item=copy.deepcopy(self.open)),
                self.event("response.content_part.added", item_id=self.open["id"],
                           output_index=index, content_index=0, part=part)]
        self.text += text
        self.logprobs += logprobs
        where = {"item_id": self.open["id"], "output_index": len(self.output),
                 "content_index": 0}
        if kind == "message":
            events.append(self.event("response.output_text.delta", **where, delta=text,
                                     logprobs=logprobs))
        else:
            events.append(self.event("response.reasoning_text.delta", **where, delta=text))
        return events

    def close(self, final: bool = True) -> list[dict[str, Any]]:
        """The open item finished (its done events, when `final`); none open: nothing."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        text, logprobs, self.text, self.logprobs = self.text, self.logprobs, "", []
        if item["type"] == "message":
            done = _message_item(item["id"], text, logprobs, "completed")
        else:
            done = _reasoning_item(item["id"], text, "completed")
        if not final:
            return [done]
        if item["type"] == "message":
            events = [self.event("response.output_text.done", **where, text=text,
                                 logprobs=logprobs)]
        else:
            events = [self.event("response.reasoning_text.done", **where, text=text)]
        events += [
            self.event("response.content_part.done", **where, part=done["content"][0]),
            self.event("response.output_item.done", output_index=where["output_index"],
                       item=done)]
        self.output.append(done)
        return events
