"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 / 4's JSON calls (the templates ask for `{"name":
function name, "parameters": dictionary of argument name and its value}`):

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., "parameters": ...}

The calls are the whole reply, objects separated by ";" (or whitespace), or everything after a
`<|python_tag|>` (Llama 3) or `<|python_start|>` (Llama 4, which may close it with
`<|python_end|>`); text before the tag is content, and so is text between Llama 4's tags
when the calls follow them (as its template writes an assistant turn: `<|python_start|>` +
content + `<|python_end|>` + calls). A reply that opens with `{"` may be calls, so
it is held back until the reply ends (the calls come then, or it all turns out content); any
other reply streams as content.

`call_patterns`: trigger `<|python_tag|>`, not `{"name": `. A bare `{"name": ` is what Llama
3.x usually writes, but it is also what any JSON answer opens with, and a trigger seizes the
text wherever it appears; the tag is a special token no ordinary answer contains. So a
constrained call is `<|python_tag|>{"name": "NAME", "parameters": ` + schema + `}`, and a bare
call is still read, unconstrained.
"""

from __future__ import annotations

import re

from aserve.server.tool_parsers.base import (
    Call,
    ParsedTools,
    ToolParser,
    call_of,
    first_marker,
    free_text,
    json_at,
    named_call_pattern,
)

TAGS = ("<|python_tag|>", "<|python_start|>")
END_TAG = "<|python_end|>"
_MAY_BE_CALLS = re.compile(r'\s*(\{\s*("|$)|$)')  # a reply that may still open with {"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False

    def call_patterns(self, tools):
        return [named_call_pattern(t, TAGS[0], key="parameters") for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        start, tag = first_marker(text, 0, TAGS)
        if start >= 0:
            head, body = text[:start], text[start + len(tag):]
        elif _MAY_BE_CALLS.match(text):
            head, body = "", text
        else:
            return ParsedTools(free_text(text, final, TAGS), [])
        if not final:
            return ParsedTools(head, [])
        if calls := json_calls(body):
            return ParsedTools(head, calls)
        inner, closed, after = body.partition(END_TAG)  # Llama 4's template: text, then calls
        if tag == TAGS[1] and closed and (calls := json_calls(after)):
            return ParsedTools(head + inner, calls)
        return ParsedTools(text, [])


def json_calls(body: str) -> list[Call] | None:
    """`{...}; {...}` (Llama 4's python tags around or between them allowed) as calls."""
    body = body.replace(END_TAG, " ").replace(TAGS[1], " ").strip()
    calls, pos = [], 0
    while pos < len(body):
        found = json_at(body, pos)
        call = call_of(found[0], "parameters") if found else None
        if call is None:
            return None
        calls.append(call)
        pos = found[1]
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls or None
