"""`hermes`: Qwen2.5 / Qwen3 / Hermes, each call in its own tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json

from aserve.server.tool_parsers.base import (
    CallPattern,
    ParsedTools,
    ToolParser,
    call_of,
    held_back,
    tool_name,
    tool_parameters,
)


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def call_patterns(self, tools):
        return [CallPattern(self.START, f'{self.START}\n{{"name": {json.dumps(tool_name(t))}, '
                            '"arguments": ', tool_parameters(t), f"}}\n{self.END}")
                for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        content, calls, pos = [], [], 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                keep = len(tail) if final else len(tail) - held_back(tail, self.START)
                content.append(tail[:keep])
                break
            content.append(text[pos:start])
            end = text.find(self.END, start)
            if end < 0:  # a call still being written (or, at the end, a broken one)
                if final:
                    content.append(text[start:])
                break
            body = text[start + len(self.START):end].strip()
            try:
                call = call_of(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                content.append(text[start:end + len(self.END)])
            else:
                calls.append(call)
            pos = end + len(self.END)
        return ParsedTools("".join(content), calls)



