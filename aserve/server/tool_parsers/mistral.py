"""`mistral`: Mistral's calls after the `[TOOL_CALLS]` token, in either of its formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   tokenizers < v11
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}    v11 and later

(v13's history form `name[CALL_ID]id[ARGS]{...}` is read too.) Text before the first marker is
content. A call is sent once its JSON (v11: the arguments object; older: the whole array) is
complete; the markers are special tokens.

`call_patterns`: for each tool both formats' single call, after the same trigger: `[TOOL_CALLS]`
+ `NAME[ARGS]` + schema JSON (ending at EOS), or `[TOOL_CALLS]` + `[{"name": "NAME",
"arguments": ` + schema JSON + `}]`. Each is exactly how its format writes one call; the model
takes the one it was trained on (several calls: one marker each).
"""

from __future__ import annotations

import re

from aserve.server.tool_parsers.base import (
    CallPattern,
    ParsedTools,
    ToolParser,
    arguments_json,
    json_at,
    json_calls_at,
    named_call_pattern,
    scan,
    skip_space,
    tool_name,
    tool_parameters,
)

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False

    def call_patterns(self, tools):
        patterns = []
        for tool in tools:
            name, schema = tool_name(tool), tool_parameters(tool)
            patterns += [CallPattern(MARKER, f"{MARKER}{name}{ARGS}", schema, ""),
                         named_call_pattern(tool, MARKER, "[", closing="]")]
        return patterns

    def parse(self, text: str, final: bool) -> ParsedTools:
        return scan(text, final, (MARKER,), read_mistral_calls)


def read_mistral_calls(text: str, start: int, marker: str, final: bool):
    pos = start + len(marker)
    first = skip_space(text, pos)
    if first == len(text):
        return None
    if text[first] in "[{":  # the JSON array of calls
        return json_calls_at(text, pos, "arguments")
    following = text.find(MARKER, pos)  # (each search stops at the next marker: linear)
    args = text.find(ARGS, pos, following if following >= 0 else len(text))
    if args < 0:
        return (None, following) if following >= 0 else None  # a marker with no call after it
    name = text[pos:args].partition(CALL_ID)[0].strip()
    found = json_at(text, args + len(ARGS))
    if found is None:
        return None
    value, end = found
    arguments = arguments_json(value) if isinstance(value, dict) else None
    if not _NAME.fullmatch(name) or arguments is None:
        return None, end
    return [(name, arguments)], end
