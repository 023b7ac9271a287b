"""What every tool-call parser is: `ToolParser` (a model's own tool-call format -> content and
calls, and the patterns its calls follow, for constrained auto calls), `ParsedTools`,
`CallPattern`, and the streaming differ every parser shares (`StreamingToolParser`).

Each parser reads the whole text so far: `parse(text, final)` gives the content that is safely
content and the calls complete in it; streaming diffs successive parses, so a streamed reply's
chunks concatenate to the non-streamed result. Text that looks like a call but does not parse
stays content.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from aserve.server.tools import FunctionCall, ToolCall


@dataclass(frozen=True)
class CallPattern:
    """How the model writes one call to one tool: `begin` (which starts with the format's
    `trigger`), then the arguments as JSON of `schema`, then `end`. From the trigger on, a
    constrained auto call is held to `begin` + schema JSON + `end` (llguidance's structural
    tags); before it and after `end` the text is free."""

    trigger: str
    begin: str
    schema: dict[str, Any]
    end: str


@dataclass
class ParsedTools:
    content: str  # the text that is not a call (so far)
    calls: list[tuple[str, str]]  # (name, arguments JSON), complete calls only


class ToolParser(ABC):
    """`skip_special_tokens` is False where the format's markers are special tokens that
    decoding would drop."""

    skip_special_tokens = True

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedTools:
        """The content and the complete calls of `text`; not `final`: text that may still
        become a call (a marker's first characters) is held back from the content."""

    def call_patterns(self, tools: list[dict[str, Any]]) -> list[CallPattern] | None:
        """One pattern per tool (`tools` as the chat template takes them: {"type":
        "function", "function": {"name", "parameters", ...}}) that constrained auto calls
        follow; None where this format's calls cannot be written so (they are then only
        parsed)."""
        return None


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what a
    stream holds back, since the next piece may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_of(obj: object, arguments_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def tool_calls_of(parsed: ParsedTools) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in parsed.calls]


@dataclass
class StreamingToolParser:
    """One choice's stream: `feed(delta)` -> (new content, new complete calls)."""

    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    calls_sent: int = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        new = tool_calls_of(ParsedTools("", parsed.calls[self.calls_sent:]))
        self.calls_sent = len(parsed.calls)
        return content, new





def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (any object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def tool_name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"]
