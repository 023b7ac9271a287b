"""Tool-call parsers: a model's own tool-call format -> (content, tool calls), for
`tool_choice: "auto"`, one module per format against `base.ToolParser`. vLLM's names:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Qwen2.5/3, Hermes)
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]  (Llama 3.x)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]        (Mistral; also
                 [TOOL_CALLS]name[ARGS]{...} of the v11 tokenizers)
"""

from __future__ import annotations

from aserve.server.tool_parsers.base import (
    CallPattern,
    ParsedTools,
    StreamingToolParser,
    ToolParser,
    held_back,
    tool_calls_of,
)
from aserve.server.tool_parsers.hermes import HermesToolParser
from aserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from aserve.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool call parser {name!r} is unknown; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}.") from None



__all__ = ["TOOL_PARSERS", "CallPattern", "ParsedTools", "StreamingToolParser", "ToolParser",
           "get_tool_parser", "held_back", "tool_calls_of"]
