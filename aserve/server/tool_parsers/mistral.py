"""`mistral`: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or the v11 tokenizers'
[TOOL_CALLS]name[ARGS]{...} (repeated after further markers).
"""

from __future__ import annotations

import json

from aserve.server.tool_parsers.base import (
    ParsedTools,
    ToolParser,
    call_of,
    held_back,
)


class MistralToolParser(ToolParser):
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedTools:
        start = text.find(self.MARKER)
        if start < 0:
            keep = len(text) if final else len(text) - held_back(text, self.MARKER)
            return ParsedTools(text[:keep], [])
        content, body = text[:start], text[start + len(self.MARKER):]
        if not final:
            return ParsedTools(content, [])
        calls = self._calls(body.strip())
        if calls is None:
            return ParsedTools(text, [])
        return ParsedTools(content, calls)

    def _calls(self, body: str) -> list[tuple[str, str]] | None:
        try:
            if self.ARGS in body:  # name[ARGS]{...}, repeated after further markers
                calls = []
                for chunk in body.split(self.MARKER):
                    name, _, arguments = chunk.partition(self.ARGS)
                    calls.append((name.strip(), json.dumps(json.loads(arguments),
                                                           ensure_ascii=False)))
                return calls
            objects = json.loads(body)
        except json.JSONDecodeError:
            return None
        objects = objects if isinstance(objects, list) else [objects]
        calls = [call_of(obj, "arguments") for obj in objects]
        return None if any(c is None for c in calls) else calls


