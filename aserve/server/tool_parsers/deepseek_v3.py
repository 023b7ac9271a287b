"""`deepseek_v3`: DeepSeek-V3 / R1 and V3.1's calls, a section of calls between full-width
markers (`｜` is U+FF5C, `▁` U+2581):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                                      V3, R1

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                          V3.1

Text before the section is content. A section is read whole: its calls are sent once it closes
(or the reply ends after its last `<｜tool▁call▁end｜>`), and if any call in it does not parse
the whole section stays content.

`call_patterns`: for each tool both formats' call, after the trigger `<｜tool▁call▁begin｜>`
(the section markers stay free text): `function<｜tool▁sep｜>NAME` + "\\n```json\\n" + schema
JSON + "\\n```<｜tool▁call▁end｜>", or `NAME<｜tool▁sep｜>` + schema JSON +
`<｜tool▁call▁end｜>`; the model takes the one it was trained on.
"""

from __future__ import annotations

import re

from aserve.server.tool_parsers.base import (
    Call,
    CallPattern,
    ParsedTools,
    ToolParser,
    arguments_json,
    json_at,
    scan,
    tool_name,
    tool_parameters,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"
_NAME = re.compile(r"[^\s<>｜]+")


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    skip_special_tokens = False

    def call_patterns(self, tools):
        patterns = []
        for tool in tools:
            name, schema = tool_name(tool), tool_parameters(tool)
            patterns += [
                CallPattern(CALL_BEGIN, f"{CALL_BEGIN}function{SEP}{name}\n{FENCE}json\n",
                            schema, f"\n{FENCE}{CALL_END}"),
                CallPattern(CALL_BEGIN, f"{CALL_BEGIN}{name}{SEP}", schema, CALL_END)]
        return patterns

    def parse(self, text: str, final: bool) -> ParsedTools:
        return scan(text, final, (CALLS_BEGIN, CALL_BEGIN), read_section)


def read_section(text: str, start: int, marker: str, final: bool):
    """A section (or a lone call) from `start`: its calls if every one parses."""
    pos = start + len(marker)
    end_marker = CALLS_END if marker == CALLS_BEGIN else CALL_END
    close = text.find(end_marker, pos)
    if close < 0 and not (final and text.rstrip().endswith(CALL_END)):
        return None
    end = len(text) if close < 0 else close + len(end_marker)
    if marker == CALL_BEGIN:
        call = section_call(text[pos:close])
        return ([call] if call else None), end
    calls, body = [], text[pos:end].removesuffix(CALLS_END)
    for chunk in body.split(CALL_END)[:-1]:
        before, _, call_text = chunk.partition(CALL_BEGIN)
        call = section_call(call_text) if not before.strip() else None
        if call is None:
            return None, end
        calls.append(call)
    whole = bool(calls) and not body.rpartition(CALL_END)[2].strip()
    return (calls if whole else None), end


def section_call(body: str) -> Call | None:
    """`function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` (V3) or `NAME<｜tool▁sep｜>{...}`
    (V3.1) as a call."""
    head, sep, tail = body.partition(SEP)
    if not sep:
        return None
    if head.strip() == "function":  # V3: the name, then the arguments in a fence
        name, _, tail = tail.partition("\n")
        tail = tail.strip()
        if tail.startswith(FENCE):
            tail = tail[len(FENCE):].removeprefix("json").removesuffix(FENCE)
    else:
        name = head
    name = name.strip()
    found = json_at(tail, 0)
    if not _NAME.fullmatch(name) or found is None or tail[found[1]:].strip():
        return None
    arguments = arguments_json(found[0])
    return None if arguments is None else (name, arguments)
