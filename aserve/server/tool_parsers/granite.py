"""`granite`: IBM Granite 3.x's calls, a JSON array after a marker:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

Granite 3.0-3.3's templates ask for `<|tool_call|>` (a special token); some 3.1+ replies write
`<tool_call>` instead, read the same (a `<tool_call>` closed after each object is `hermes`,
which Granite 4 uses). A closing `<|/tool_call|>` (`</tool_call>`) after the JSON is read as
part of the call: Phi-4-mini writes `<|tool_call|>{"name": ..., "arguments": ...}<|/tool_call|>`.
Text before the marker is content; the calls are sent once the JSON is complete and what
follows it is not a closing tag still being written (at the latest when the reply ends).

`call_patterns`: `<|tool_call|>` + `[{"name": "NAME", "arguments": ` + schema JSON + `}]`, the
single call as the templates ask for it (several calls: one marker each).
"""

from __future__ import annotations

from aserve.server.tool_parsers.base import (
    ParsedTools,
    ToolParser,
    json_calls_at,
    named_call_pattern,
    scan,
    skip_space,
)

MARKERS = ("<|tool_call|>", "<tool_call>")
CLOSERS = ("<|/tool_call|>", "</tool_call>")  # (each marker's)


class GraniteToolParser(ToolParser):
    name = "granite"
    skip_special_tokens = False

    def call_patterns(self, tools):
        return [named_call_pattern(t, MARKERS[0], "[", closing="]") for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        return scan(text, final, MARKERS, read_granite_calls)


def read_granite_calls(text: str, start: int, marker: str, final: bool):
    pos = start + len(marker)
    first = skip_space(text, pos)
    if first == len(text):
        return None
    if text[first] not in "[{":
        return None, pos  # not a call: the marker stays content, the text goes on
    found = json_calls_at(text, pos, "arguments")
    if found is None or found[0] is None:
        return found
    calls, end = found
    after, closer = skip_space(text, end), CLOSERS[MARKERS.index(marker)]
    if text.startswith(closer, after):
        return calls, after + len(closer)
    if not final and len(text) - after < len(closer) and closer.startswith(text[after:]):
        return None  # its closing tag may be coming
    return calls, end
