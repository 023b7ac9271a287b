"""`hermes`: Qwen2.5 / Qwen3 / Hermes 2 Pro and 3 / Granite 4, each call in its own tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Read leniently, as these models write it: any whitespace around the JSON, keys in either order
(Hermes 2 Pro writes "arguments" first), `arguments` as a JSON string that holds the object,
one closing brace too few or too many, several calls in one tag (objects, or an array), a
`</tool_call>` inside a JSON string (the call ends at the first one outside the strings), and
a last call whose `</tool_call>` never came (the reply ended at EOS right after a whole
object). A call is sent once its `</tool_call>` is written.
"""

from __future__ import annotations

import re

from aserve.server.tool_parsers.base import (
    Call,
    ParsedTools,
    ToolParser,
    call_of,
    json_at,
    named_call_pattern,
    scan,
)

START, END = "<tool_call>", "</tool_call>"
_TAG_OR_QUOTE = re.compile(r'</tool_call>|"')
_SEPARATORS = re.compile(r"[\s,;]*")
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # to a string's closing quote


class HermesToolParser(ToolParser):
    name = "hermes"
    skip_special_tokens = False  # Hermes' tokenizers mark <tool_call> special

    def call_patterns(self, tools):
        return [named_call_pattern(t, START, "\n", closing=f"\n{END}") for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        return scan(text, final, (START,), read_tagged_call)


def read_tagged_call(text: str, start: int, marker: str, final: bool):
    body_start = start + len(marker)
    close = closing_tag(text, body_start)
    if close < 0 and not final:
        return None
    if close < 0:
        close = text.find(END, body_start)  # (a string left open: the first tag, as written)
    body = text[body_start:] if close < 0 else text[body_start:close]
    return hermes_calls(body, closed=close >= 0), (len(text) if close < 0 else close + len(END))


def closing_tag(text: str, pos: int) -> int:
    """Where the `</tool_call>` after `pos` that is not inside a JSON string starts (the
    arguments may hold the tag: code, docs); -1 if none yet."""
    while (found := _TAG_OR_QUOTE.search(text, pos)) is not None:
        if found.group() == END:
            return found.start()
        string = _STRING_REST.match(text, found.end())
        if string is None:
            return -1
        pos = string.end()
    return -1


def hermes_calls(body: str, closed: bool) -> list[Call] | None:
    """The calls in one tag's body: a JSON object, possibly a few braces over, or (`closed`:
    not cut off) one short; or several objects, or an array of them, which some models put
    in one tag."""
    body = body.strip()
    for candidate in (body, body + "}") if closed else (body,):
        calls, pos = [], 0
        while (found := json_at(candidate, pos)) is not None:
            value, pos = found
            got = [call_of(v, "arguments") for v in (value if isinstance(value, list) else [value])]
            if not got or None in got:
                return None
            calls += got
            pos = _SEPARATORS.match(candidate, pos).end()
            if not candidate[pos:].replace("}", "").strip():
                return calls
    return None
