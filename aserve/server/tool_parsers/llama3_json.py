"""`llama3_json`: Llama 3.x's JSON calls, the whole reply (after an optional <|python_tag|>):

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., "parameters": ...}
"""

from __future__ import annotations

import json

from aserve.server.tool_parsers.base import (
    ParsedTools,
    ToolParser,
    call_of,
)


class Llama3JsonToolParser(ToolParser):
    """The reply is the call(s), JSON objects separated by ";"; anything else is content."""

    TAG = "<|python_tag|>"
    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.strip()
        looks_like_call = body.startswith(("{", self.TAG)) or (
            not final and self.TAG.startswith(body))
        if not looks_like_call:
            return ParsedTools(text, [])
        if not final:
            return ParsedTools("", [])
        calls = []
        for part in body.removeprefix(self.TAG).split(";"):
            try:
                call = call_of(json.loads(part), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedTools(text, [])
            calls.append(call)
        return ParsedTools("", calls)


