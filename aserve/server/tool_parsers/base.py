"""What every tool-call parser is: `ToolParser` (a model's own tool-call format -> content and
calls, and the patterns its calls follow, for constrained auto calls), `ParsedTools`,
`CallPattern`, the streaming differ every parser shares (`StreamingToolParser`), and the pieces
most formats are made of (`scan`: content with calls that open at a marker; `call_of`,
`json_at`).

Each parser reads the whole text so far: `parse(text, final)` gives the content that is safely
content and the calls complete in it; streaming diffs successive parses, so a streamed reply's
chunks concatenate to the non-streamed result. For that, a parse of a longer text never takes
back what a shorter one gave: its content starts with the shorter one's, its calls too. Text
that looks like a call but does not parse stays content, as written. A parse also says up to
where the text is settled (`ParsedTools.settled`: the next parse may start there), so a stream
does not read its earlier calls again at every delta (that was quadratic in the calls).

The text is the reply as decoded, without the EOS / stop token that ended it (`<|call|>`,
`<|eom_id|>`, ...): in formats whose call ends at EOS, the end of a `final` text ends the call.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

from aserve.server.tools import FunctionCall, ToolCall

Call = tuple[str, str]  # (name, arguments JSON)


@dataclass(frozen=True)
class CallPattern:
    """How the model writes one call to one tool: `begin` (which starts with the format's
    `trigger`), then the arguments as JSON of `schema` (or, for a format whose arguments are
    not JSON, as the Lark `grammar` given instead), then `end`. From the trigger on, a
    constrained auto call is held to `begin` + arguments + `end` (a structural tag,
    `structured_output/constraints.py`); before it and after `end` the text is free."""

    trigger: str
    begin: str
    schema: dict[str, Any] | None
    end: str
    grammar: str | None = None


@dataclass
class ParsedTools:
    content: str  # the text that is not a call (so far)
    calls: list[Call]  # complete calls only
    # Where the text is read for good: parsing `text[settled:]` alone gives the rest of the
    # content (after its first `settled_content` characters) and no call before it; every
    # call lies before it. 0: the whole text is read again (formats that need the whole).
    settled: int = 0
    settled_content: int = 0


class ToolParser(ABC):
    """One model format. `name` is its `--tool-call-parser` name. `skip_special_tokens` is
    False where the format's markers are special tokens that decoding would drop. `tools` are
    the request's tools (as the chat template takes them), set by whoever makes the parser for
    a request, for formats whose argument values are typed by the tools' schemas
    (qwen3_coder); without them values are read as JSON where they parse."""

    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool] = True
    tools: list[dict[str, Any]] | None = None

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedTools:
        """The content and the complete calls of `text`; not `final`: text that may still
        become a call (a marker's first characters, a call not yet closed) is held back."""

    def call_patterns(self, tools: list[dict[str, Any]]) -> list[CallPattern] | None:
        """Patterns (`tools` as the chat template takes them: {"type": "function",
        "function": {"name", "parameters", ...}}) that constrained auto calls follow; None
        where this format's calls cannot be written so (they are then only parsed)."""
        return None


# ------------------------------------------------------------------------------- markers


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what a
    stream holds back, since the next piece may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def held_back_any(text: str, markers: Iterable[str]) -> int:
    return max((held_back(text, m) for m in markers), default=0)


def first_marker(text: str, pos: int, markers: Iterable[str]) -> tuple[int, str]:
    """(index, marker) of the first of `markers` in `text` from `pos` (the longest where
    several start there); (-1, "") if none. One pass that stops there: a search per marker
    would read to the end of the text for each marker that is absent, once per call."""
    markers = tuple(markers)
    found = _any_of(markers).search(text, pos) if markers else None
    return (found.start(), found.group()) if found else (-1, "")


@lru_cache(maxsize=64)
def _any_of(markers: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))


# A call reader: (text, where its marker starts, the marker, final) -> None while the call is
# still being written (at the end: not a call), else (its calls, or None when it is not one,
# and where it ends).
ReadCall = Callable[[str, int, str, bool], "tuple[list[Call] | None, int] | None"]


def scan(text: str, final: bool, markers: tuple[str, ...], read_call: ReadCall) -> ParsedTools:
    """Content with calls that open at one of `markers`, each read by `read_call`. Content
    ends before a call still being written, and before a possible marker start. Settled: the
    text up to that point (a call is read from its marker on, and no marker starts in the
    content sent), so a stream reads each piece of text about once."""
    content, calls, pos, settled_content = [], [], 0, 0
    while True:
        start, marker = first_marker(text, pos, markers)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - held_back_any(tail, markers)])
            break
        found = read_call(text, start, marker, final)
        if found is None:
            content.append(text[pos:] if final else text[pos:start])
            break
        got, end = found
        content.append(text[pos:end] if got is None else text[pos:start])
        calls.extend(got or ())
        pos, settled_content = end, settled_content + len(content[-1])
    return ParsedTools("".join(content), calls, pos + len(content[-1]),
                       settled_content + len(content[-1]))


def free_text(text: str, final: bool, markers: Iterable[str]) -> str:
    """`text`, in which no call starts, as content: less a possible marker start at its end
    unless `final`."""
    return text if final else text[:len(text) - held_back_any(text, markers)]


# ---------------------------------------------------------------------------------- JSON

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The index of the first character at or after `pos` that is not whitespace."""
    return _SPACE.match(text, pos).end()


def json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value that starts at `pos` (after whitespace) and the index after it; None if
    no complete value starts there."""
    pos = skip_space(text, pos)
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):  # ValueError: also an int past Python's digit limit
        return None


def arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON text: an object (none given: {}), or a string that holds one
    (some models write them so); None when they are neither."""
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # NaN / Infinity: not JSON
        return None


def call_of(obj: object, arguments_key: str = "arguments") -> Call | None:
    """A {"name": ..., "arguments" (or `arguments_key`, or "parameters"): {...}} object as a
    call, also nested as OpenAI writes it ({"type": "function", "function": {...}}); None when
    it is not one."""
    if isinstance(obj, dict) and "name" not in obj and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in (arguments_key, "arguments", "parameters"):
        if key in obj:
            arguments = arguments_json(obj[key])
            break
    else:
        arguments = "{}"
    return None if arguments is None else (obj["name"], arguments)


def json_calls_at(text: str, pos: int, arguments_key: str = "arguments"
                  ) -> tuple[list[Call] | None, int] | None:
    """A JSON array of call objects (or one object) at `pos`: (its calls, or None when it is
    not such, and the index after it); None when no complete JSON value starts there."""
    found = json_at(text, pos)
    if found is None:
        return None
    value, end = found
    objects = value if isinstance(value, list) else [value]
    calls = [call_of(obj, arguments_key) for obj in objects]
    return (None if not calls or None in calls else calls), end


# ------------------------------------------------------------------------------- results


def tool_calls_of(parsed: ParsedTools) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in parsed.calls]


@dataclass
class StreamingToolParser:
    """One choice's stream: `feed(delta)` -> (new content, new complete calls). Each delta
    parses the text again from where the last parse settled (`ParsedTools.settled`), so the
    calls and content already read are not read again at every delta."""

    parser: ToolParser
    pending: str = ""  # the text after the settled part
    content_sent: int = 0  # of the content of `pending`
    calls_sent: int = 0  # of the calls in `pending`

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += delta
        parsed = self.parser.parse(self.pending, final)
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        new = tool_calls_of(ParsedTools("", parsed.calls[self.calls_sent:]))
        self.calls_sent = len(parsed.calls)
        if parsed.settled:
            self.pending = self.pending[parsed.settled:]
            self.content_sent -= parsed.settled_content
            self.calls_sent = 0
        return content, new


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (any object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def tool_name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"]


def named_call_pattern(tool: dict[str, Any], trigger: str, opening: str = "",
                       key: str = "arguments", closing: str = "") -> CallPattern:
    """The call most JSON formats write, held to `tool`'s schema: `trigger` + `opening` +
    `{"name": NAME, "<key>": ` + the arguments + `}` + `closing`."""
    return CallPattern(trigger, f'{trigger}{opening}{{"name": {json.dumps(tool_name(tool))}, '
                                f'"{key}": ', tool_parameters(tool), "}" + closing)
