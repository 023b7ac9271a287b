"""`gpt_oss` (vLLM's `openai`): gpt-oss's harmony messages. The prompt ends with
`<|start|>assistant`; the reply is one or more messages, each a header, `<|message|>`, a body,
and an end (`<|end|>`; `<|call|>` and `<|return|>` are EOS, so they end the text instead):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}                                           (the call; then <|call|>, EOS)

    <|channel|>final<|message|>It is sunny in Paris.            (the answer; then <|return|>)

A header names the channel (`analysis`, `commentary`, `final`) and may name a recipient
(`to=functions.NAME`, before or after the channel) and a content type (`<|constrain|>json`).
A message to `functions.NAME` is a call whatever its channel (its body the arguments JSON); a
`final` or `commentary` message without a recipient (a preamble to the user) is content, sent as
it is written; an `analysis` message is reasoning, not content. A message this cannot read (no
channel, a recipient other than `functions.*`, arguments that are not a JSON object) stays
content as written; so does stray text where no header comes within `MAX_HEADER` characters.
The markers are special tokens.

`call_patterns`: trigger `<|channel|>commentary to=functions.`, each call
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` + schema JSON + `<|call|>`.
"""

from __future__ import annotations

import re

from aserve.server.tool_parsers.base import (
    Call,
    CallPattern,
    ParsedTools,
    ToolParser,
    arguments_json,
    first_marker,
    free_text,
    json_at,
    tool_name,
    tool_parameters,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
BOUNDARIES = (*ENDS, START)  # what ends a body
MAX_HEADER = 256  # characters from a message's start to its `<|message|>`
TRIGGER = f"{CHANNEL}commentary to=functions."
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
CONTENT_CHANNELS = ("final", "commentary")


class GptOssToolParser(ToolParser):
    name = "gpt_oss"
    skip_special_tokens = False

    def call_patterns(self, tools):
        return [CallPattern(TRIGGER, f"{TRIGGER}{tool_name(t)} <|constrain|>json{MESSAGE}",
                            tool_parameters(t), ENDS[1]) for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        content, calls, pos = [], [], 0
        settled = settled_content = 0  # (each message is read alone: parsing resumes at one)
        while pos < len(text):
            if pos > settled:
                settled, settled_content = pos, settled_content + len(content[-1])
            head_end = text.find(MESSAGE, pos, pos + MAX_HEADER + len(MESSAGE))
            if head_end < 0:
                if len(text) - pos < MAX_HEADER + len(MESSAGE):  # a header may be coming
                    content.append(text[pos:] if final else "")
                    break
                stray_end = text.find(START, pos + 1)  # stray text, up to the next message
                if stray_end < 0:
                    content.append(free_text(text[pos:], final, (START,)))
                    break
                content.append(text[pos:stray_end])
                pos = stray_end
                continue
            kind, name = message_kind(text[pos:head_end])
            body_start = head_end + len(MESSAGE)
            body_end, boundary = first_marker(text, body_start, BOUNDARIES)
            if body_end < 0 and not final:
                if kind == "content":
                    content.append(free_text(text[body_start:], False, BOUNDARIES))
                break
            if body_end < 0:
                body_end = len(text)
            after = body_end + (len(boundary) if boundary in ENDS else 0)
            body = text[body_start:body_end]
            piece = body if kind == "content" else ""  # (one piece a message: see `settled`)
            if kind == "call" and (call := function_call(name, body)) is not None:
                calls.append(call)
            elif kind not in ("content", "reasoning"):
                piece = text[pos:after]
            content.append(piece)
            pos = after
        if pos >= len(text) and pos > settled:
            settled, settled_content = pos, settled_content + len(content[-1])
        return ParsedTools("".join(content), calls, settled, settled_content)


def message_kind(header: str) -> tuple[str, str]:
    """("call", function name), ("reasoning" | "content" | "unknown", "") of a header."""
    recipient = _RECIPIENT.search(header)
    channel = _CHANNEL.search(header)
    if recipient:
        target = recipient.group(1)
        if target.startswith("functions.") and len(target) > len("functions."):
            return "call", target[len("functions."):]
        return "unknown", ""
    if channel is None:
        return "unknown", ""
    if channel.group(1) == "analysis":
        return "reasoning", ""
    return ("content" if channel.group(1) in CONTENT_CHANNELS else "unknown"), ""


def function_call(name: str, body: str) -> Call | None:
    found = json_at(body, 0)
    if found is None or not isinstance(found[0], dict) or body[found[1]:].strip():
        return None
    arguments = arguments_json(found[0])
    return None if arguments is None else (name, arguments)
