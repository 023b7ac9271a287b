"""The tool-call parsers (`aserve/server/tool_parsers/`) against replies as each model family
writes them: golden cases per parser (content before calls, several calls, nested / unicode /
escaped arguments, lenient and malformed calls, text that merely mentions a marker) parse to the
stated (content, calls); streamed through `StreamingToolParser` in many seeded random splits
(1-character pieces, splits forced inside every marker and inside JSON strings) the content
deltas concatenate to the non-streamed content and the calls equal the non-streamed calls; no
prefix of a reply ever takes back content or gives a call the whole reply does not (a call is
never sent before it is complete). `parser_for_template` picks the right parser for real chat
templates (tests/data/chat_templates) and from a vocabulary; what a template renders for an
assistant turn with tool calls reads back as the same calls; a reply written exactly as a
`call_patterns` pattern (what a constrained call emits) parses back to its call; and hostile
inputs (deep nesting, megabytes of partial markers) parse without exceptions.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aserve.engine.chat_template import render
from aserve.server.tool_parsers import (
    TOOL_PARSERS,
    ParsedTools,
    StreamingToolParser,
    ToolParser,
    get_tool_parser,
    parser_for_template,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


def tool(name: str, properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"The {name} tool.",
        "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


TOOLS = [
    tool("get_weather", {"city": {"type": "string", "description": "A city"},
                         "days": {"type": "integer", "description": "Days ahead"},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                                  "description": "The unit"}}, ("city",)),
    tool("get_time", {"zone": {"type": "string", "description": "A time zone"}}),
    tool("search", {"query": {"type": "string", "description": "What to find"},
                    "filters": {"type": "object", "description": "Filters"},
                    "limit": {"type": "integer", "description": "At most"},
                    "tags": {"type": "array", "items": {"type": "string"},
                             "description": "Tags"}}, ("query",)),
    tool("set_flags", {"enabled": {"type": "boolean", "description": "On or off"},
                       "ratio": {"type": "number", "description": "A ratio"},
                       "note": {"type": ["string", "null"], "description": "A note"}}),
    tool("run_code", {"code": {"type": "string", "description": "Python source"},
                      "timeout": {"type": "number", "description": "Seconds"}}, ("code",)),
]


@dataclass
class Case:
    parser: str
    id: str
    text: str
    content: str
    calls: list[tuple[str, Any]]
    tools: list[dict] | None = field(default=None)

    def make(self) -> ToolParser:
        parser = get_tool_parser(self.parser)
        parser.tools = self.tools
        return parser


CASES: list[Case] = []


def case(parser: str, id: str, text: str, content: str, calls=(), tools=None) -> None:
    CASES.append(Case(parser, id, text, content, list(calls), tools))


# ------------------------------------------------------------------------------- hermes
# Qwen2.5 / Qwen3 / Hermes 2 Pro / Hermes 3: one JSON object per <tool_call> ... </tool_call>.

case("hermes", "content-then-call",
     "I'll check the current weather in Paris for you.\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "I'll check the current weather in Paris for you.\n",
     [("get_weather", {"city": "Paris", "days": 3})])
case("hermes", "parallel-calls",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}\n'
     "</tool_call>",
     "\n",
     [("get_weather", {"city": "Rome", "unit": "celsius"}),
      ("get_time", {"zone": "Europe/Rome"})])
case("hermes", "hermes-2-pro-arguments-first",
     '<tool_call>\n{"arguments": {"query": "TSLA fundamentals"}, "name": "search"}\n</tool_call>',
     "", [("search", {"query": "TSLA fundamentals"})])
case("hermes", "nested-unicode-escapes-braces",
     '<tool_call>\n{"name": "search", "arguments": {"query": "caf\u00e9 \\"na\u00efve\\" {x} [y] '
     '\u4f60\u597d \U0001f600 \\\\n", "filters": {"lang": ["fr", "zh"], "range": {"from": 1, '
     '"to": [2, {"deep": null}]}, "exact": true}, "limit": 10}}\n</tool_call>',
     "",
     [("search", {"query": "caf\u00e9 \"na\u00efve\" {x} [y] \u4f60\u597d \U0001f600 \\n",
                  "filters": {"lang": ["fr", "zh"], "range": {"from": 1,
                                                             "to": [2, {"deep": None}]},
                              "exact": True}, "limit": 10})])
case("hermes", "closing-tag-inside-a-string",
     '<tool_call>\n{"name": "run_code", "arguments": {"code": '
     '"print(\'<tool_call>x</tool_call>\')"}}\n</tool_call>',
     "", [("run_code", {"code": "print('<tool_call>x</tool_call>')"})])
case("hermes", "one-closing-brace-missing",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo"})])
case("hermes", "one-closing-brace-extra",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo"})])
case("hermes", "two-objects-in-one-tag",
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n{"name": "get_weather", '
     '"arguments": {"city": "Kyiv"}}\n</tool_call>',
     "", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Kyiv"})])
case("hermes", "an-array-in-one-tag",
     '<tool_call>\n[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": '
     '{"zone": "CET"}}]\n</tool_call>',
     "", [("get_time", {}), ("get_time", {"zone": "CET"})])
case("hermes", "openai-shaped-object",
     '<tool_call>\n{"type": "function", "function": {"name": "get_weather", "arguments": '
     '"{\\"city\\": \\"Quito\\"}"}}\n</tool_call>',
     "", [("get_weather", {"city": "Quito"})])
case("hermes", "no-closing-tag-at-eos",
     'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}',
     "Checking.\n", [("get_time", {"zone": "UTC"})])
case("hermes", "arguments-as-a-json-string",
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}\n</tool_call>',
     "", [("get_weather", {"city": "Lima"})])
case("hermes", "no-arguments",
     '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", {})])
case("hermes", "text-after-the-calls",
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nI will wait for it.',
     "\nI will wait for it.", [("get_time", {})])
case("hermes", "mentions-the-marker",
     "Wrap each call in a <tool_call> tag, then stop.",
     "Wrap each call in a <tool_call> tag, then stop.")
case("hermes", "mentions-both-tags",
     "Write <tool_call>NAME</tool_call> and wait. {Braces} [too].",
     "Write <tool_call>NAME</tool_call> and wait. {Braces} [too].")
case("hermes", "starts-with-a-brace",
     '{"name": "get_time", "arguments": {}} is what a call looks like.',
     '{"name": "get_time", "arguments": {}} is what a call looks like.')
case("hermes", "malformed-json-stays-content",
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nDone.',
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nDone.')
case("hermes", "a-name-that-is-not-a-string-stays-content",
     '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>')
case("hermes", "good-call-after-a-malformed-one",
     '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>\n',
     [("get_time", {"zone": "CET"})])
case("hermes", "cut-off-call-at-eos-stays-content",
     'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')

# -------------------------------------------------------------------------- qwen3_coder
# Qwen3-Coder: XML-ish calls, raw values typed by the tools' schemas.

case("qwen3_coder", "typed-parameters",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
     "</tool_call>",
     "", [("get_weather", {"city": "San Francisco", "days": 3, "unit": "celsius"})], TOOLS)
case("qwen3_coder", "content-then-two-calls-all-types",
     "I'll search and then set the flags.\n\n<tool_call>\n<function=search>\n"
     "<parameter=query>\n12345\n</parameter>\n<parameter=filters>\n"
     "{\"lang\": \"en\", \"n\": [1, 2]}\n</parameter>\n<parameter=limit>\n5\n</parameter>\n"
     "<parameter=tags>\n[\"a\", \"b\"]\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=set_flags>\n"
     "<parameter=enabled>\nTrue\n</parameter>\n<parameter=ratio>\n0.25\n</parameter>\n"
     "<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>",
     "I'll search and then set the flags.\n\n\n",
     [("search", {"query": "12345", "filters": {"lang": "en", "n": [1, 2]}, "limit": 5,
                  "tags": ["a", "b"]}),
      ("set_flags", {"enabled": True, "ratio": 0.25, "note": None})], TOOLS)
case("qwen3_coder", "multiline-code-value",
     "<tool_call>\n<function=run_code>\n<parameter=code>\ndef f(x):\n    return {\"a\": x}\n\n"
     "print(f('</function>'[:2]))\n</parameter>\n</function>\n</tool_call>",
     "", [("run_code",
           {"code": "def f(x):\n    return {\"a\": x}\n\nprint(f('</function>'[:2]))"})],
     TOOLS)
case("qwen3_coder", "python-literal-object",
     "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n<parameter=filters>\n"
     "{'lang': 'en', 'strict': True}\n</parameter>\n</function>\n</tool_call>",
     "", [("search", {"query": "x", "filters": {"lang": "en", "strict": True}})], TOOLS)
case("qwen3_coder", "missing-parameter-end",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nK\u00f8benhavn\n<parameter=days>\n2\n"
     "</function>\n</tool_call>",
     "", [("get_weather", {"city": "K\u00f8benhavn", "days": 2})], TOOLS)
case("qwen3_coder", "missing-tool-call-end-at-eos",
     "<tool_call>\n<function=get_time>\n<parameter=zone>\nAsia/Tokyo\n</parameter>\n</function>",
     "", [("get_time", {"zone": "Asia/Tokyo"})], TOOLS)
case("qwen3_coder", "bare-function",
     "Sure.\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>",
     "Sure.\n", [("get_time", {"zone": "UTC"})], TOOLS)
case("qwen3_coder", "no-schema-values-as-json",
     "<tool_call>\n<function=unknown_tool>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\nhi there"
     "\n</parameter>\n<parameter=o>\n{\"a\": [true]}\n</parameter>\n</function>\n</tool_call>",
     "", [("unknown_tool", {"n": 3, "s": "hi there", "o": {"a": [True]}})], TOOLS)
case("qwen3_coder", "hermes-json-inside-tool-call",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hanoi"}}\n</tool_call>',
     "", [("get_weather", {"city": "Hanoi"})], TOOLS)
case("qwen3_coder", "mentions-the-markers",
     "Calls look like <function=NAME> with <parameter=KEY> tags; <tool_call> wraps them.",
     "Calls look like <function=NAME> with <parameter=KEY> tags; <tool_call> wraps them.",
     (), TOOLS)
case("qwen3_coder", "text-inside-the-function-stays-content",
     "<tool_call>\n<function=get_time>\nzone is UTC\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_time>\nzone is UTC\n</function>\n</tool_call>", (), TOOLS)

# -------------------------------------------------------------------------- llama3_json
# Llama 3.1 / 3.2 / 3.3 / 4: {"name": ..., "parameters": {...}}, bare or after a python tag.

case("llama3_json", "python-tag",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Dallas", "unit": '
     '"fahrenheit"}}',
     "", [("get_weather", {"city": "Dallas", "unit": "fahrenheit"})])
case("llama3_json", "bare-json",
     '{"name": "get_weather", "parameters": {"city": "San Francisco", "days": 2}}',
     "", [("get_weather", {"city": "San Francisco", "days": 2})])
case("llama3_json", "bare-json-semicolons",
     '{"name": "search", "parameters": {"query": "test"}}; {"name": "get_time", '
     '"parameters": {}}',
     "", [("search", {"query": "test"}), ("get_time", {})])
case("llama3_json", "content-before-python-tag",
     'Let me look that up.<|python_tag|>{"name": "search", "parameters": {"query": "Z\u00fcrich '
     '\\"old town\\" {tips}", "filters": {"tags": ["a", "b"], "max": 3}}}',
     "Let me look that up.",
     [("search", {"query": "Z\u00fcrich \"old town\" {tips}",
                  "filters": {"tags": ["a", "b"], "max": 3}})])
case("llama3_json", "arguments-key",
     '{"name": "get_time", "arguments": {"zone": "PST"}}', "", [("get_time", {"zone": "PST"})])
case("llama3_json", "type-function-key",
     '{"type": "function", "name": "get_time", "parameters": {"zone": "EST"}}',
     "", [("get_time", {"zone": "EST"})])
case("llama3_json", "openai-shaped-object",
     '{"type": "function", "function": {"name": "get_time", "parameters": {"zone": "GMT"}}}',
     "", [("get_time", {"zone": "GMT"})])
case("llama3_json", "llama4-python-start",
     '<|python_start|>{"name": "get_weather", "parameters": {"city": "Lagos"}}<|python_end|>',
     "", [("get_weather", {"city": "Lagos"})])
case("llama3_json", "llama4-template-turn",
     '<|python_start|>Let me check.<|python_end|>{"name": "get_weather", "parameters": {"city": '
     '"Lima"}}{"name": "get_time", "parameters": {}}',
     "Let me check.", [("get_weather", {"city": "Lima"}), ("get_time", {})])
case("llama3_json", "json-answer-stays-content",
     '{"answer": 42, "unit": "km"}', '{"answer": 42, "unit": "km"}')
case("llama3_json", "starts-with-brace-text",
     "{braces} are how Python writes sets.", "{braces} are how Python writes sets.")
case("llama3_json", "starts-with-bracket",
     '[{"name": "get_time"}] is a list.', '[{"name": "get_time"}] is a list.')
case("llama3_json", "mentions-python-tag",
     "The token <|python_tag|> starts tool code.", "The token <|python_tag|> starts tool code.")
case("llama3_json", "builtin-tool-call-stays-content",
     '<|python_tag|>brave_search.call(query="weather in Menlo Park")',
     '<|python_tag|>brave_search.call(query="weather in Menlo Park")')
case("llama3_json", "cut-off-json-stays-content",
     '{"name": "get_weather", "parameters": {"city": "Ber',
     '{"name": "get_weather", "parameters": {"city": "Ber')
case("llama3_json", "plain-answer", "It is 21 degrees in Paris today.",
     "It is 21 degrees in Paris today.")

# ----------------------------------------------------------------------------- pythonic
# Llama 3.2 / Llama 4 / ToolACE / Gemma 3 pythonic templates: [f(a=1), g(b="x")].

case("pythonic", "one-call",
     '[get_weather(city="San Francisco", unit="celsius")]',
     "", [("get_weather", {"city": "San Francisco", "unit": "celsius"})])
case("pythonic", "two-calls",
     "[get_weather(city='Paris', days=2), get_time(zone=\"CET\")]",
     "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})])
case("pythonic", "nested-literals",
     '[search(query="na\u00efve \\"quoted\\" {braces} [brackets]", filters={"tags": ["a", "b"], '
     '"range": (1, 2), "ok": True, "none": None, "neg": -1.5}, limit=-5)]',
     "", [("search", {"query": "na\u00efve \"quoted\" {braces} [brackets]",
                      "filters": {"tags": ["a", "b"], "range": [1, 2], "ok": True,
                                  "none": None, "neg": -1.5}, "limit": -5})])
case("pythonic", "json-literals",
     "[set_flags(enabled=true, ratio=0.5, note=null)]",
     "", [("set_flags", {"enabled": True, "ratio": 0.5, "note": None})])
case("pythonic", "no-arguments", "[get_time()]", "", [("get_time", {})])
case("pythonic", "llama4-python-tags",
     '<|python_start|>[get_weather(city="Tokyo")]<|python_end|>',
     "", [("get_weather", {"city": "Tokyo"})])
case("pythonic", "whitespace-around",
     '\n [get_time(zone="UTC")] \n', "", [("get_time", {"zone": "UTC"})])
case("pythonic", "citation-stays-content",
     "[1] Smith et al. showed this in 2020.", "[1] Smith et al. showed this in 2020.")
case("pythonic", "bracketed-word-stays-content",
     "[Note] get_weather(city='x') is how you call it.",
     "[Note] get_weather(city='x') is how you call it.")
case("pythonic", "looks-like-a-call-but-is-not",
     "[get_weather(city=\"Paris\"] is missing a parenthesis.",
     "[get_weather(city=\"Paris\"] is missing a parenthesis.")
case("pythonic", "positional-argument-stays-content",
     '[get_weather("Paris")]', '[get_weather("Paris")]')
case("pythonic", "code-is-not-evaluated",
     "[get_weather(city=__import__('os').getcwd())]",
     "[get_weather(city=__import__('os').getcwd())]")
case("pythonic", "text-before-the-list-stays-content",
     'Let me check: [get_weather(city="Oslo")]', 'Let me check: [get_weather(city="Oslo")]')

# ------------------------------------------------------------------------------ mistral
# Mistral: [TOOL_CALLS] then a JSON array (tokenizers < v11) or NAME[ARGS]{...} (v11+).

case("mistral", "pre-v11-array",
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris, France", '
     '"unit": "celsius"}}]',
     "", [("get_weather", {"city": "Paris, France", "unit": "celsius"})])
case("mistral", "pre-v11-two-calls-with-ids",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}, "id": "a1B2c3D4e"}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}, "id": "f5G6h7I8j"}]',
     "", [("get_weather", {"city": "Nice"}), ("get_time", {"zone": "CET"})])
case("mistral", "pre-v11-content-before",
     'Let me check both.[TOOL_CALLS] [{"name": "search", "arguments": {"query": "\\u00e9t\u00e9 '
     '{x} [y]", "filters": {"a": [1, {"b": null}]}}}]',
     "Let me check both.",
     [("search", {"query": "\u00e9t\u00e9 {x} [y]", "filters": {"a": [1, {"b": None}]}})])
case("mistral", "v11-one-call",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 1}',
     "", [("get_weather", {"city": "Paris", "days": 1})])
case("mistral", "v11-two-calls",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": '
     '"Europe/Paris"}',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})])
case("mistral", "v11-content-before-nested-unicode",
     'I will search.[TOOL_CALLS]search[ARGS]{"query": "\u6771\u4eac \\"ramen\\" [best]", '
     '"filters": {"open": true, "price": [1, 2]}}',
     "I will search.",
     [("search", {"query": "\u6771\u4eac \"ramen\" [best]",
                  "filters": {"open": True, "price": [1, 2]}})])
case("mistral", "v13-call-id",
     '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}',
     "", [("get_time", {"zone": "UTC"})])
case("mistral", "mentions-the-marker",
     "I would emit [TOOL_CALLS] here, but no tool fits.",
     "I would emit [TOOL_CALLS] here, but no tool fits.")
case("mistral", "cut-off-array-stays-content",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}')
case("mistral", "array-of-non-calls-stays-content",
     '[TOOL_CALLS][1, 2, 3] and more', '[TOOL_CALLS][1, 2, 3] and more')
case("mistral", "v11-bad-name-stays-content",
     '[TOOL_CALLS]get weather now[ARGS]{"city": "Paris"}',
     '[TOOL_CALLS]get weather now[ARGS]{"city": "Paris"}')
case("mistral", "plain-text-with-brackets",
     "[INST] is the user turn; [ARGS] follows a name.",
     "[INST] is the user turn; [ARGS] follows a name.")

# ------------------------------------------------------------------------------ gpt_oss
# gpt-oss harmony: analysis (reasoning), commentary to=functions.NAME (a call), final.

ANALYSIS = ("<|channel|>analysis<|message|>The user wants the weather in Tokyo. Use get_weather."
            "<|end|>")
case("gpt_oss", "analysis-then-call",
     ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city":"Tokyo"}',
     "", [("get_weather", {"city": "Tokyo"})])
case("gpt_oss", "recipient-in-the-role",
     ANALYSIS + "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
     '<|message|>{"city": "Tokyo", "days": 2}',
     "", [("get_weather", {"city": "Tokyo", "days": 2})])
case("gpt_oss", "recipient-first-in-the-reply",
     ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "JST"}',
     "", [("get_time", {"zone": "JST"})])
case("gpt_oss", "analysis-then-final",
     "<|channel|>analysis<|message|>Simple greeting; no tool needed.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hello! How can I help you today?",
     "Hello! How can I help you today?")
case("gpt_oss", "preamble-then-call",
     ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me check that for you."
     "<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json"
     '<|message|>{"query": "caf\u00e9 \\"du coin\\" {open}", "filters": {"hours": [8, 22], '
     '"terrace": true}}',
     "Let me check that for you.",
     [("search", {"query": "caf\u00e9 \"du coin\" {open}",
                  "filters": {"hours": [8, 22], "terrace": True}})])
case("gpt_oss", "two-calls-then-final",
     ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": "Tokyo"}<|call|><|start|>assistant<|channel|>'
     'commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "Asia/Tokyo"}'
     "<|call|><|start|>assistant<|channel|>final<|message|>Both requested.",
     "Both requested.",
     [("get_weather", {"city": "Tokyo"}), ("get_time", {"zone": "Asia/Tokyo"})])
case("gpt_oss", "malformed-arguments-stay-content",
     ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": ',
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city": ')
case("gpt_oss", "builtin-recipient-stays-content",
     "<|channel|>analysis<|message|>Search the web.<|end|><|start|>assistant<|channel|>analysis "
     'to=browser.search code<|message|>{"query": "weather"}',
     "<|start|>assistant<|channel|>analysis to=browser.search code"
     '<|message|>{"query": "weather"}')
case("gpt_oss", "final-mentions-markers",
     "<|channel|>final<|message|>Harmony calls go to=functions.NAME on commentary.",
     "Harmony calls go to=functions.NAME on commentary.")
case("gpt_oss", "plain-text-without-harmony",
     "Just a plain answer with no headers at all.",
     "Just a plain answer with no headers at all.")

# -------------------------------------------------------------------------- deepseek_v3
# DeepSeek V3 / R1 (function<sep>NAME + ```json fence) and V3.1 (NAME<sep>{...}).

B, E = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CB, CE = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
case("deepseek_v3", "v3-content-then-call",
     f"Let me check the weather.{B}{CB}function{SEP}get_weather\n```json\n"
     f'{{"city": "Hangzhou"}}\n```{CE}{E}',
     "Let me check the weather.", [("get_weather", {"city": "Hangzhou"})])
case("deepseek_v3", "v3-two-calls",
     f"{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Beijing\", \"days\": 2}}\n```{CE}"
     f"\n{CB}function{SEP}get_time\n```json\n{{\"zone\": \"Asia/Shanghai\"}}\n```{CE}{E}",
     "", [("get_weather", {"city": "Beijing", "days": 2}),
          ("get_time", {"zone": "Asia/Shanghai"})])
case("deepseek_v3", "v31-two-calls",
     f'{B}{CB}get_weather{SEP}{{"city": "Shenzhen"}}{CE}{CB}search{SEP}{{"query": "\u5929\u6c14 '
     f'\\"today\\" {{x}}", "filters": {{"n": [1, 2]}}}}{CE}{E}',
     "", [("get_weather", {"city": "Shenzhen"}),
          ("search", {"query": "\u5929\u6c14 \"today\" {x}", "filters": {"n": [1, 2]}})])
case("deepseek_v3", "v3-calls-end-missing-at-eos",
     f"{B}{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}",
     "", [("get_time", {})])
case("deepseek_v3", "malformed-call-keeps-the-section-as-content",
     f"{B}{CB}function{SEP}get_time\n```json\n{{\"zone\": }}\n```{CE}{E}",
     f"{B}{CB}function{SEP}get_time\n```json\n{{\"zone\": }}\n```{CE}{E}")
case("deepseek_v3", "mentions-the-marker",
     f"The section opens with {B} and that is all.",
     f"The section opens with {B} and that is all.")
case("deepseek_v3", "lone-call-without-section",
     f'{CB}get_time{SEP}{{"zone": "UTC"}}{CE}', "", [("get_time", {"zone": "UTC"})])

# ------------------------------------------------------------------------------ granite
# Granite 3.x: <|tool_call|> then a JSON array of calls.

case("granite", "one-call",
     '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Boston", "unit": '
     '"fahrenheit"}}]',
     "", [("get_weather", {"city": "Boston", "unit": "fahrenheit"})])
case("granite", "two-calls-with-space",
     '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Austin"}}, {"name": '
     '"get_time", "arguments": {"zone": "America/Chicago"}}]',
     "", [("get_weather", {"city": "Austin"}), ("get_time", {"zone": "America/Chicago"})])
case("granite", "content-before-nested",
     'Sure.<|tool_call|>[{"name": "search", "arguments": {"query": "\u00fcber \\"x\\" ]}", '
     '"filters": {"a": {"b": [true, null]}}}}]',
     "Sure.", [("search", {"query": "\u00fcber \"x\" ]}", "filters": {"a": {"b": [True, None]}}})])
case("granite", "granite-3.1-plain-tag",
     '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     "", [("get_time", {"zone": "UTC"})])
case("granite", "one-object",
     '<|tool_call|>{"name": "get_time", "arguments": {}}', "", [("get_time", {})])
case("granite", "phi-4-mini-closed-objects",
     'Sure.<|tool_call|>{"name": "get_time", "arguments": {"zone": "UTC"}}<|/tool_call|>'
     '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Lyon"}}<|/tool_call|>',
     "Sure.", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Lyon"})])
case("granite", "text-after-the-array",
     '<|tool_call|>[{"name": "get_time", "arguments": {}}] I have called it.',
     " I have called it.", [("get_time", {})])
case("granite", "mentions-the-marker",
     "Respond with <|tool_call|> followed by a JSON list.",
     "Respond with <|tool_call|> followed by a JSON list.")
case("granite", "cut-off-array-stays-content",
     '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}',
     '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}')


# ------------------------------------------------------------------------------ helpers

MARKERS = (
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
    "<|python_tag|>", "<|python_start|>", "<|python_end|>", "[TOOL_CALLS]", "[ARGS]",
    "[CALL_ID]", "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>",
    "<|constrain|>", "to=functions.", B, E, CB, CE, SEP, "```", "<|tool_call|>")


def calls_of(parsed: ParsedTools) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in parsed.calls]


def forced_cuts(text: str) -> list[list[int]]:
    """Cut sets that split every marker at each of its inner positions, and every JSON
    string right after its quotes and backslashes, and in its middle."""
    starts = [(m.start(), len(marker)) for marker in MARKERS
              for m in re.finditer(re.escape(marker), text)]
    longest = max((n for _, n in starts), default=0)
    cut_sets = [sorted({s + k for s, n in starts if k < n}) for k in range(1, longest)]
    inside_strings = [i + 1 for i, c in enumerate(text) if c in '"\\{[' and i + 1 < len(text)]
    cut_sets.append(inside_strings)
    cut_sets.append([(m.start() + m.end()) // 2 for m in re.finditer(r'"(?:[^"\\]|\\.)*"', text)])
    cut_sets.append([i for i in range(1, len(text)) if text[i - 1] in ":,"])
    return [cuts for cuts in cut_sets if cuts]


def random_cuts(text: str, seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(1, max(1, min(len(text) - 1, 16)))
        out.append(sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1))))
    return out


def stream(parser: ToolParser, text: str, cuts: list[int], final_alone: bool = False):
    """The content deltas joined and the calls sent, feeding `text` cut at `cuts`."""
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamer = StreamingToolParser(parser)
    content, calls = [], []
    for i, piece in enumerate(pieces):
        delta, new = streamer.feed(piece, final=not final_alone and i == len(pieces) - 1)
        content.append(delta)
        calls += [(c.function.name, c.function.arguments) for c in new]
    if final_alone:
        delta, new = streamer.feed("", final=True)
        content.append(delta)
        calls += [(c.function.name, c.function.arguments) for c in new]
    return "".join(content), calls


def check_prefixes(parser: ToolParser, text: str, whole: ParsedTools) -> None:
    """Every prefix, not final: its content extends the previous prefix's and starts the whole
    reply's; its calls start the whole reply's calls (none sent before it is complete); the
    text after where it settled parses alone to the rest of its content and no call."""
    previous = ""
    for end in range(len(text) + 1):
        parsed = parser.parse(text[:end], final=False)
        assert parsed.content.startswith(previous), (end, previous, parsed.content)
        assert whole.content.startswith(parsed.content), (end, parsed.content)
        assert parsed.calls == whole.calls[:len(parsed.calls)], (end, parsed.calls)
        rest = parser.parse(text[parsed.settled:end], final=False)
        assert (parsed.content[:parsed.settled_content] + rest.content, rest.calls) == \
            (parsed.content, []), (end, parsed.settled)
        previous = parsed.content


def check_streams(parser: ToolParser, text: str, seed: int) -> None:
    whole = parser.parse(text, final=True)
    check_prefixes(parser, text, whole)
    cut_sets = forced_cuts(text) + random_cuts(text, seed, 25)
    cut_sets.append(list(range(1, len(text))))  # 1-character pieces
    for cuts in cut_sets:
        for final_alone in (False, True):
            content, calls = stream(parser, text, cuts, final_alone)
            assert content == whole.content, (cuts, content)
            assert calls == whole.calls, (cuts, calls)


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


# -------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("c", CASES, ids=[f"{c.parser}-{c.id}" for c in CASES])
def test_golden_replies_parse_whole_and_streamed(c: Case):
    parser = c.make()
    whole = parser.parse(c.text, final=True)
    assert (whole.content, calls_of(whole)) == (c.content, c.calls)
    check_streams(parser, c.text, seed_of(c.parser + c.id))


def test_every_parser_has_golden_cases():
    assert {c.parser for c in CASES} == {cls.name for cls in TOOL_PARSERS.values()}
    assert TOOL_PARSERS["openai"] is TOOL_PARSERS["gpt_oss"]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_empty_and_whitespace_replies(name):
    parser = get_tool_parser(name)
    for text in ("", " ", "\n\n"):
        parsed = parser.parse(text, final=True)
        assert parsed.calls == [] and parsed.content in (text, "")
        assert parser.parse(text, final=False).calls == []


# ----------------------------------------------------------------------------- detection

TEMPLATE_PARSERS = {
    "deepseek-v3": "deepseek_v3",
    "deepseek-v3.1": "deepseek_v3",
    "gemma-3-pythonic": "pythonic",
    "gpt-oss": "gpt_oss",
    "granite-3.3-instruct": "granite",
    "hermes-2-pro": "hermes",
    "hermes-3-llama-3.1": "hermes",
    "llama-3.2-instruct": "llama3_json",
    "llama-3.2-pythonic": "pythonic",
    "llama-3.3-instruct": "llama3_json",
    "llama-4-json": "llama3_json",
    "llama-4-pythonic": "pythonic",
    "llama-4-scout-instruct": "llama3_json",
    "magistral-small-2509": "mistral",
    "mistral-7b-instruct-v0.3": "mistral",
    "mistral-small-3.1": "mistral",
    "phi-4-mini-llama-cpp": "granite",  # (llama.cpp's tool template for Phi-4-mini)
    "qwen2.5-instruct": "hermes",
    "qwen3": "hermes",
    "qwen3-coder": "qwen3_coder",
    "toolace": "pythonic",
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def test_every_template_in_the_data_folder_has_an_expected_parser():
    assert {p.stem for p in TEMPLATES.glob("*.jinja")} == set(TEMPLATE_PARSERS)


@pytest.mark.parametrize("name", sorted(TEMPLATE_PARSERS))
def test_the_parser_is_found_in_the_chat_template(name):
    assert parser_for_template(template(name)) == TEMPLATE_PARSERS[name]
    # the template decides, whatever the vocabulary holds
    assert parser_for_template(template(name), {"[TOOL_CALLS]", "<|python_tag|>"}) == \
        TEMPLATE_PARSERS[name]


class Vocab:
    def __init__(self, tokens):
        self.tokens = set(tokens)

    def token_to_id(self, token):
        return 7 if token in self.tokens else None


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("tokens, expected", [
    ({"<|channel|>", "<|constrain|>", "<|message|>"}, "gpt_oss"),
    ({"<|channel|>"}, "hermes"),  # a channel token alone is not harmony
    ({"<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5cAssistant\uff5c>"}, "deepseek_v3"),
    ({"[TOOL_CALLS]", "[ARGS]"}, "mistral"),
    ({"<|tool_call|>", "<|start_of_role|>"}, "granite"),
    ({"<|python_tag|>", "<|eot_id|>"}, "llama3_json"),
    ({"<|python_start|>", "<|eot|>"}, "llama3_json"),
    ({"<tool_call>", "<|im_end|>"}, "hermes"),
    (set(), "hermes"),
])
def test_without_tool_markers_in_the_template_the_vocabulary_decides(tokens, expected):
    for source in (None, "", CHATML):
        assert parser_for_template(source, tokens) == expected
        assert parser_for_template(source, Vocab(tokens)) == expected
    assert parser_for_template(None) == "hermes"


# ---------------------------------------------------------------------------- round trip

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
SEARCH = ("search", {"query": "caf\u00e9 \"best\" {x} [y]", "limit": 2,
                     "filters": {"open": True, "tags": ["a", "b"], "near": None}})
PLAIN = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})]
ROUND_TRIPS = {  # template -> the calls its assistant turn renders in the model's own format
    "deepseek-v3": [WEATHER, SEARCH],
    "deepseek-v3.1": [WEATHER, SEARCH],
    "gpt-oss": [SEARCH],  # one call a message
    "granite-3.3-instruct": [WEATHER, SEARCH],
    "hermes-2-pro": [SEARCH],  # (it opens one <tool_call> for all calls)
    "hermes-3-llama-3.1": [WEATHER, SEARCH],
    "llama-3.2-instruct": [SEARCH],  # one call a turn
    "llama-3.3-instruct": [SEARCH],
    "llama-4-json": [WEATHER, SEARCH],
    "llama-4-pythonic": PLAIN,  # (it quotes every value as a string)
    "llama-4-scout-instruct": [WEATHER, SEARCH],
    "magistral-small-2509": [WEATHER, SEARCH],
    "mistral-7b-instruct-v0.3": [WEATHER, SEARCH],
    "mistral-small-3.1": [WEATHER, SEARCH],
    "phi-4-mini-llama-cpp": [WEATHER, SEARCH],
    "qwen2.5-instruct": [WEATHER, SEARCH],
    "qwen3": [WEATHER, SEARCH],
    "qwen3-coder": [WEATHER, SEARCH],
}
# Not the model's own format, so no trip: llama-3.2-pythonic and toolace write values unquoted
# ("%s"); gemma-3-pythonic's comma between arguments is set inside its loop, so never written.
STRING_ARGUMENTS = {"deepseek-v3.1"}  # it concatenates the arguments: they go as JSON text
TURN_ENDS = ("</s>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|eot|>", "<|eom|>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|end_of_text|>", "<|call|>",
             "<end_of_turn>", "<|return|>", "<|end|>")


def render_turn(source: str, calls, string_arguments: bool, content: str = "") -> str:
    """The text `source` writes for an assistant turn that makes `calls`: the conversation
    rendered with that turn, less the prompt it follows, less the turn's end token."""
    tool_calls = [{"id": f"call{i:05d}", "type": "function", "function": {
        "name": name, "arguments": json.dumps(args) if string_arguments else args}}
        for i, (name, args) in enumerate(calls)]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": tool_calls}]
    # (Hermes' templates recurse forever on a union type such as ["string", "null"], in
    # jinja2 as here: the tools rendered are those without one)
    variables = {"tools": TOOLS[:3], "bos_token": "<s>", "eos_token": "</s>"}
    prompt = render(source, messages=messages[:1], add_generation_prompt=True, **variables)
    whole = render(source, messages=messages, add_generation_prompt=False, **variables)
    common = 0
    while common < min(len(prompt), len(whole)) and prompt[common] == whole[common]:
        common += 1
    turn = re.sub(r"^\s*<think>\s*</think>\s*", "", whole[common:]).rstrip()  # (Qwen3's)
    while turn.endswith(TURN_ENDS):
        turn = turn[:-len(next(e for e in TURN_ENDS if turn.endswith(e)))].rstrip()
    return turn


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_what_the_template_writes_for_tool_calls_reads_back(name):
    calls = ROUND_TRIPS[name]
    turn = render_turn(template(name), calls, name in STRING_ARGUMENTS)
    parser = get_tool_parser(parser_for_template(template(name)))
    parser.tools = TOOLS
    parsed = parser.parse(turn, final=True)
    assert calls_of(parsed) == calls, turn
    assert parsed.content.strip() == "", turn
    check_streams(parser, turn, seed_of(name))


WITH_CONTENT = ["deepseek-v3", "deepseek-v3.1", "granite-3.3-instruct", "llama-4-scout-instruct",
                "magistral-small-2509", "phi-4-mini-llama-cpp", "qwen2.5-instruct", "qwen3",
                "qwen3-coder"]  # (templates that write an assistant turn's text before its calls)


@pytest.mark.parametrize("name", WITH_CONTENT)
def test_text_the_template_writes_before_tool_calls_reads_back_as_content(name):
    calls = ROUND_TRIPS[name]
    turn = render_turn(template(name), calls, name in STRING_ARGUMENTS, "Let me check.")
    parser = get_tool_parser(parser_for_template(template(name)))
    parser.tools = TOOLS
    parsed = parser.parse(turn, final=True)
    assert (parsed.content.strip(), calls_of(parsed)) == ("Let me check.", calls), turn
    check_streams(parser, turn, seed_of(name))


# ------------------------------------------------------------------------- call patterns

PATTERN_ARGUMENTS = {
    "get_weather": {"city": "S\u00e3o Paulo", "days": 2, "unit": "celsius"},
    "get_time": {},
    "search": {"query": "a \"quoted\" {brace} </tool_call> [TOOL_CALLS]",
               "filters": {"deep": [{"x": None}, [1.5, -2]]}, "limit": 1, "tags": ["\u00e9", ""]},
    "set_flags": {"enabled": False, "ratio": 0.1, "note": None},
    "run_code": {"code": "print('}\\n')\n", "timeout": 2},
}
EOS = ("<|call|>",)  # an EOS a pattern may end with: the engine cuts it from the text
BEFORE = {  # free text a reply may hold before a constrained call
    "gpt_oss": ANALYSIS + "<|start|>assistant",
    "deepseek_v3": f"Checking.{B}",
}
AFTER = {"deepseek_v3": E}


def pattern_text(pattern, arguments, compact: bool, ensure_ascii: bool = True,
                 cut_eos: bool = True) -> str:
    """What a constrained call writes (less the EOS that ends it, as the engine cuts it)."""
    separators = (",", ":") if compact else None

    def as_json(value) -> str:
        return json.dumps(value, separators=separators, ensure_ascii=ensure_ascii)

    if pattern.grammar is None:
        written = as_json(arguments)
    else:  # qwen3_coder's XML parameters: text as it is, anything else as JSON
        written = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else as_json(value)}"
            "\n</parameter>\n" for key, value in arguments.items())
    text = pattern.begin + written + pattern.end
    for eos in EOS if cut_eos else ():
        text = text.removesuffix(eos)
    return text


PATTERN_PARSERS = sorted(name for name, cls in TOOL_PARSERS.items()
                         if cls().call_patterns(TOOLS) is not None)


def test_which_parsers_have_call_patterns():
    assert set(PATTERN_PARSERS) == {"deepseek_v3", "deepseek_v31", "gpt_oss", "granite",
                                    "hermes", "llama3_json", "llama4_json", "mistral", "openai",
                                    "qwen3_coder", "qwen3_xml"}


@pytest.mark.parametrize("name", PATTERN_PARSERS)
def test_a_reply_written_as_a_call_pattern_parses_back_to_that_call(name):
    parser = get_tool_parser(name)
    patterns = parser.call_patterns(TOOLS)
    assert patterns and all(p.begin.startswith(p.trigger) for p in patterns)
    names = [n for n in PATTERN_ARGUMENTS for p in patterns if p.begin.count(n)]
    assert set(names) == set(PATTERN_ARGUMENTS)  # every tool has a pattern
    for pattern in patterns:
        tool_name = next(n for n in PATTERN_ARGUMENTS if n in pattern.begin)
        arguments = PATTERN_ARGUMENTS[tool_name]
        for compact in (True, False):
            for before, content in (("", ""), (BEFORE.get(name, "Sure. "), "Sure. ")):
                if name in ("gpt_oss", "openai") and before:
                    content = ""  # (the analysis before it is reasoning)
                if name == "deepseek_v3" and before:
                    content = "Checking."
                text = before + pattern_text(pattern, arguments, compact)
                if before:
                    text += AFTER.get(name, "")
                parsed = parser.parse(text, final=True)
                assert calls_of(parsed) == [(tool_name, arguments)], text
                assert parsed.content == content, text
        check_streams(parser, text, seed_of(pattern.begin))


@pytest.mark.parametrize("name", ["hermes", "mistral", "granite", "deepseek_v3"])
def test_constrained_calls_one_after_another_parse_back_in_order(name):
    parser = get_tool_parser(name)
    patterns = parser.call_patterns(TOOLS)
    separator = "\n" if name == "hermes" else ""
    for first in patterns:
        texts, expected = [], []
        for pattern in [first, *patterns[:3]]:
            tool_name = next(n for n in PATTERN_ARGUMENTS if n in pattern.begin)
            texts.append(pattern_text(pattern, PATTERN_ARGUMENTS[tool_name], True))
            expected.append((tool_name, PATTERN_ARGUMENTS[tool_name]))
        text = BEFORE.get(name, "") + separator.join(texts) + AFTER.get(name, "")
        parsed = parser.parse(text, final=True)
        assert calls_of(parsed) == expected, text
    check_streams(parser, text, seed_of(name))


# ---------------------------------------------------------------------------- hostility

PARSER_MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "<function=f>", "<parameter=p>", "</parameter>",
                    "</function>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>", "<|python_start|>", "<|python_end|>", '{"name": '),
    "pythonic": ("<|python_start|>", "[f(", "a=", "<|python_end|>"),
    "mistral": ("[TOOL_CALLS]", "f[ARGS]", "[CALL_ID]", "[ARGS]"),
    "gpt_oss": ("<|start|>assistant", "<|channel|>commentary to=functions.f", "<|message|>",
                "<|end|>", "<|call|>"),
    "deepseek_v3": (B, CB, "function", SEP, CE, E),
    "granite": ("<|tool_call|>", "<tool_call>"),
}
MB = 1 << 20


def hostile_texts(name: str) -> list[str]:
    markers = PARSER_MARKERS[name]
    opening = markers[0]
    partial = "".join(m[:-1] + "x" for m in markers)
    whole = "".join(markers)
    return [
        "[" * 100_000,
        "{" * 100_000,
        '{"name": "f", "arguments": ' + "[" * 100_000,
        opening + '{"name": "f", "arguments": ' + "{" * 100_000,
        opening + "[" * 50_000 + "]" * 50_000,
        '[f(a=' + "[" * 100_000,
        opening + '{"name": "f", "arguments": {"n": ' + "9" * 5000 + "}}",
        opening + '{"name": "f", "arguments": {"n": NaN}}',
        partial * (MB // len(partial)),
        whole * (MB // len(whole) // 2),
        (opening + '"') * (MB // (len(opening) + 1) // 2),
        "x" * MB + opening,
        opening + "x" * MB,
        " " * MB + opening + " " * MB,
        *EXTRA_HOSTILE.get(name, ()),
    ]


EXTRA_HOSTILE = {  # inputs that were quadratic in one parse
    "qwen3_coder": ["<tool_call>\n<function=f>\n" + "<parameter=p>\nx\n" * 60_000 + "</function>"],
    "mistral": ["[TOOL_CALLS]x" * 80_000 + 'f[ARGS]{"a": 1}'],
    "gpt_oss": ["<|start|>assistant<|channel|>analysis<|message|>x<|end|>" * 10_000],
}


@pytest.mark.parametrize("name", sorted(PARSER_MARKERS))
def test_hostile_replies_parse_without_exceptions(name):
    parser = get_tool_parser(name)
    parser.tools = TOOLS
    for text in hostile_texts(name):
        for final in (False, True):
            parsed = parser.parse(text, final)
            assert isinstance(parsed, ParsedTools)
            assert all(isinstance(n, str) and json.loads(a) is not None for n, a in parsed.calls)


@pytest.mark.parametrize("name", sorted(PARSER_MARKERS))
def test_hostile_replies_stream_without_exceptions(name):
    """Streaming reparses the whole text at each delta: 40 kB in 400 deltas."""
    parser = get_tool_parser(name)
    markers = PARSER_MARKERS[name]
    rng = random.Random(seed_of(name))
    pieces = [*markers, *(m[:-1] for m in markers), "{", "[", '"', "\\", "}", "]", " ", "x"]
    text = "".join(rng.choice(pieces) for _ in range(40_000 // 6))
    whole = parser.parse(text, final=True)
    content, calls = stream(parser, text, list(range(100, len(text), 100)))
    assert (content, calls) == (whole.content, whole.calls)


@pytest.fixture(scope="module")
def demo_tokenizer():
    """The demo model's tokenizer, as llguidance reads it: every marker is text in it."""
    import llguidance
    import tokenizers

    from aserve.assets import DEMO_MODEL_DIR

    hf = tokenizers.Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    return hf, llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=[2])


@pytest.mark.parametrize("name", [n for n in PATTERN_PARSERS if n in TOOL_PARSERS and
                                  TOOL_PARSERS[n].name == n])
def test_the_auto_grammar_takes_exactly_the_calls_its_patterns_write(name, demo_tokenizer):
    """What a constrained call writes is what the grammar allows: each pattern's text (after
    free text) is accepted token by token, and the grammar is back in free text after it;
    the same call with a name no tool has, or a required argument left out, is refused.
    (llguidance holds an object's properties to its schema's order and takes non-ASCII
    characters as themselves, not as \\u escapes: the arguments are written so.)"""
    import llguidance

    from aserve.server.protocol import ChatCompletionRequest
    from aserve.structured_output.constraints import compile_job, constraint_job

    hf, tokenizer = demo_tokenizer
    parser = get_tool_parser(name)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=TOOLS)
    spec = body.tool_constraint(parser.call_patterns(body.template_tools()))
    compiled = compile_job(constraint_job(spec), tokenizer, llguidance.LLParserLimits())
    assert "grammar" in compiled, compiled

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, compiled["grammar"])
        return all(matcher.consume_token(t) for t in hf.encode(text).ids)

    for pattern in parser.call_patterns(TOOLS):
        tool_name = next(n for n in PATTERN_ARGUMENTS if n in pattern.begin)
        written = pattern_text(pattern, PATTERN_ARGUMENTS[tool_name], compact=True,
                               ensure_ascii=False, cut_eos=False)
        assert accepts("Sure. " + written + " Done."), written
        assert not accepts("Sure. " + written.replace(tool_name, "no_such_tool", 1))
    weather = next(p for p in parser.call_patterns(TOOLS) if "get_weather" in p.begin)
    assert not accepts(pattern_text(weather, {"days": 2}, compact=True,  # city is required
                                    cut_eos=False))
