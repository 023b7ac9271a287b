"""How one chat request's replies become content and tool calls, for its tool mode
(`ToolFields.tool_mode`): `ReplyTools` (a whole reply: `split`) and `ChoiceToolStream` (one
streamed choice), and `RequiredCallsScanner`, which reads a `required` reply's JSON array of
calls a character at a time.

One rule for calls, streamed or not, in every mode: a call is sent once it is complete, whole
(its id, name and arguments in one delta); a reply cut off inside a call (`max_tokens`) gives
that call's text back as content, with finish_reason "length" — never a call with cut-off
arguments, which clients would take for a real one."""

from __future__ import annotations

import json
from dataclasses import dataclass

from aserve.server.tool_parsers import StreamingToolParser, ToolParser, tool_calls_of
from aserve.server.tools import FunctionCall, ToolCall


@dataclass
class _ArrayCall:
    start: int  # where its object starts in the reply
    name: str | None = None
    arguments: str = ""  # raw text of "parameters" so far
    arguments_done: bool = False
    done: bool = False  # its object has closed


class RequiredCallsScanner:
    """Reads a `required` reply — the grammar's JSON array of {"name": ..., "parameters": ...}
    objects — a character at a time, so that a stream can send each call's name as soon as it
    is complete and its arguments as they are written. The arguments are the raw text of the
    "parameters" value (compact JSON by default), streamed and not, so streamed fragments
    concatenate to the non-streamed arguments."""

    def __init__(self) -> None:
        self.calls: list[_ArrayCall] = []
        self._text = ""
        self._depth = 0
        self._in_string = self._escaped = False
        self._token_start = 0  # of the string being read
        self._key: str | None = None  # the call object's key whose value is being read
        self._reading_key = False  # next string at depth 2 is a key
        self._value_start: int | None = None  # of the current depth-2 value

    @property
    def text(self) -> str:
        return self._text

    def feed(self, text: str) -> None:
        start = len(self._text)
        self._text += text
        for i in range(start, len(self._text)):
            self._step(i, self._text[i])
        call = self.calls[-1] if self.calls else None
        if call is not None and self._key == "parameters" and self._value_start is not None:
            call.arguments = self._text[self._value_start:].rstrip()

    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_read(json.loads(self._text[self._token_start:i + 1]))
            return
        if c == '"':
            self._in_string, self._token_start = True, i
            if self._depth == 2 and not self._reading_key and self._value_start is None:
                self._value_start = i
        elif c in "{[":
            if self._depth == 1 and c == "{":
                self.calls.append(_ArrayCall(i))
                self._reading_key, self._key = True, None
            elif self._depth == 2 and self._value_start is None:
                self._value_start = i
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_done(i)
                self.calls[-1].done = True
        elif self._depth == 2 and c == ",":
            self._value_done(i)
            self._reading_key = True
        elif self._depth == 2 and c == ":":
            self._reading_key = False
        elif self._depth == 2 and not c.isspace() and self._value_start is None:
            self._value_start = i  # a number, true, false, null

    def _string_read(self, value: str) -> None:
        if self._reading_key:
            self._key = value
        elif self._key == "name":
            self.calls[-1].name = value
            self._value_start = None

    def _value_done(self, end: int) -> None:
        """The call object's current value ends before `end` (a ',' or the object's '}')."""
        if self._key == "parameters" and self._value_start is not None:
            self.calls[-1].arguments = self._text[self._value_start:end].strip()
            self.calls[-1].arguments_done = True
        self._key, self._value_start = None, None


class ReplyTools:
    """How one chat request's replies become content and tool calls, whole (`split`) or
    streamed (`stream`), for its tool mode (`ToolFields.tool_mode`)."""

    def __init__(self, body, parser: ToolParser | None) -> None:
        self.body, self.parser = body, parser
        self.mode = getattr(body, "tool_mode", "none")
        # parallel_tool_calls false: an auto reply's calls after its first are dropped, as
        # vLLM drops them (`required` is held to one call by its grammar)
        self.max_calls = None if getattr(body, "parallel_tool_calls", True) is not False else 1

    def split(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; a call cut off stays content (module rule)."""
        if self.mode == "named":
            if finish_reason != "stop":
                return text, []
            name = self.body.tool_choice.function.name
            return None, [ToolCall(function=FunctionCall(name=name, arguments=text))]
        if self.mode == "required":
            scanner = RequiredCallsScanner()
            scanner.feed(text)
            calls = [c for c in scanner.calls if c.done]
            cut = next((c for c in scanner.calls if not c.done), None)
            return (text[cut.start:] if cut is not None else None), [
                ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls]
        if self.mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text, final=True)
            calls = tool_calls_of(parsed)[:self.max_calls]
            blank = calls and not parsed.content.strip()  # (kept as is: streams send it so)
            return (None if blank else parsed.content), calls
        return text, []

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


class ChoiceToolStream:
    """One streamed choice: `feed(text delta, finish_reason)` -> (content delta or None,
    tool-call deltas or None). Each call goes out whole once complete (module rule): a named
    call when the reply ends, a `required` call when its object closes, an auto call when the
    parser reads it complete in the text."""

    def __init__(self, tools: ReplyTools) -> None:
        self.tools, self.num_calls = tools, 0
        self.parsing = (StreamingToolParser(tools.parser)
                        if tools.mode == "auto" and tools.parser is not None else None)
        self.scanner = RequiredCallsScanner() if tools.mode == "required" else None
        self.text = ""  # a named reply so far

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str, finish_reason: str | None
             ) -> tuple[str | None, list[dict] | None]:
        if self.tools.mode == "named":
            self.text += text
            if finish_reason is None:
                return None, None
            content, calls = self.tools.split(self.text, finish_reason)
            return content, self._deltas(calls) or None
        if self.scanner is not None:
            self.scanner.feed(text)
            done = [c for c in self.scanner.calls if c.done][self.num_calls:]
            deltas = self._deltas([ToolCall(function=FunctionCall(
                name=c.name, arguments=c.arguments)) for c in done])
            content = None
            if finish_reason is not None and finish_reason != "stop":
                cut = next((c for c in self.scanner.calls if not c.done), None)
                content = self.scanner.text[cut.start:] if cut is not None else None
            return content, deltas or None
        if self.parsing is not None:
            content, calls = self.parsing.feed(text, final=finish_reason is not None)
            if self.tools.max_calls is not None:
                calls = calls[:max(0, self.tools.max_calls - self.num_calls)]
            return content, self._deltas(calls) or None
        return text, None

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        deltas = [{"index": self.num_calls + i, "id": c.id, "type": "function",
                   "function": {"name": c.function.name, "arguments": c.function.arguments}}
                  for i, c in enumerate(calls)]
        self.num_calls += len(calls)
        return deltas
