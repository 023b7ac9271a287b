"""`granite`: IBM Granite 3.x's calls, a JSON array after a marker:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

Granite 3.0-3.3's templates ask for `<|tool_call|>` (a special token); some 3.1+ replies write
`<tool_call>` instead, read the same (no closing tag: that is `hermes`, which Granite 4 uses).
Text before the marker is content; the calls are sent once the array is complete.

`call_patterns`: `<|tool_call|>` + `[{"name": "NAME", "arguments": ` + schema JSON + `}]`, the
single call as the templates ask for it (several calls: one marker each).
"""

from __future__ import annotations

import json

from aserve.server.tool_parsers.base import (
    CallPattern,
    ParsedTools,
    ToolParser,
    json_calls_at,
    scan,
    skip_space,
    tool_name,
    tool_parameters,
)

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    name = "granite"
    skip_special_tokens = False

    def call_patterns(self, tools):
        return [CallPattern(MARKERS[0], f'{MARKERS[0]}[{{"name": {json.dumps(tool_name(t))}, '
                            '"arguments": ', tool_parameters(t), "}]") for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        return scan(text, final, MARKERS, read_granite_calls)


def read_granite_calls(text: str, start: int, marker: str, final: bool):
    pos = start + len(marker)
    first = skip_space(text, pos)
    if first == len(text):
        return None
    if text[first] not in "[{":
        return None, pos  # not a call: the marker stays content, the text goes on
    return json_calls_at(text, pos, "arguments")
