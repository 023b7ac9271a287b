"""Tool-call parsers: a model's own tool-call format -> (content, tool calls), for
`tool_choice: "auto"`, one module per format against `base.ToolParser` (vLLM's names):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen2.5/3, Hermes
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...  Qwen3-Coder
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]  Llama 3.x / 4
    pythonic     [get_weather(city="Paris"), ...]                          Llama 3.2 / 4
    mistral      [TOOL_CALLS][{...}, ...]  or  [TOOL_CALLS]NAME[ARGS]{...}  Mistral
    gpt_oss      harmony: <|channel|>commentary to=functions.NAME ...<|message|>{...}  gpt-oss
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>  DeepSeek
    granite      <|tool_call|>[{"name": ..., "arguments": {...}}]          Granite 3.x

`parser_for_template` (`detect.py`) picks one from the model's chat template and vocabulary.
vLLM's other names are accepted too: `openai` (gpt_oss), `qwen3_xml` (qwen3_coder),
`llama4_json` (llama3_json), `llama4_pythonic` (pythonic), `deepseek_v31` (deepseek_v3).
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
from aserve.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from aserve.server.tool_parsers.detect import parser_for_template
from aserve.server.tool_parsers.gpt_oss import GptOssToolParser
from aserve.server.tool_parsers.granite import GraniteToolParser
from aserve.server.tool_parsers.hermes import HermesToolParser
from aserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from aserve.server.tool_parsers.mistral import MistralToolParser
from aserve.server.tool_parsers.pythonic import PythonicToolParser
from aserve.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (
        HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser, PythonicToolParser,
        MistralToolParser, GptOssToolParser, DeepSeekV3ToolParser, GraniteToolParser)}
# vLLM's other names for these formats, so that its command lines work as they are
TOOL_PARSERS.update({
    "openai": GptOssToolParser, "qwen3_xml": Qwen3CoderToolParser,
    "llama4_json": Llama3JsonToolParser, "llama4_pythonic": PythonicToolParser,
    "deepseek_v31": DeepSeekV3ToolParser})


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool call parser {name!r} is unknown; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}.") from None


__all__ = ["TOOL_PARSERS", "CallPattern", "ParsedTools", "StreamingToolParser", "ToolParser",
           "get_tool_parser", "held_back", "parser_for_template", "tool_calls_of"]
