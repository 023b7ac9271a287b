"""`--reasoning-parser NAME`: a reasoning model's `<think>...</think>` -> `reasoning_content`
beside `content` (vLLM's names):

    deepseek_r1   the reply opens in reasoning (the template has opened `<think>`; the model may
                  repeat it) and `</think>` ends it; without `</think>` all of it is reasoning
    qwen3         reasoning only where the reply opens with `<think>` (thinking may be switched
                  off, and then the whole reply is content)

`parse(text, final)` reads the whole text so far, so streaming diffs successive parses and the
streamed pieces concatenate to the whole reply's. Structured outputs and tool calls apply to the
content after the reasoning (`END` is where a constraint starts).
"""

from __future__ import annotations

from dataclasses import dataclass

from aserve.server.tool_parsers import held_back

START, END = "<think>", "</think>"


@dataclass
class ParsedReasoning:
    reasoning: str
    content: str


class ReasoningParser:
    """deepseek_r1: the reply is reasoning until `</think>` (an opening `<think>` dropped)."""

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        if not final and START.startswith(text):
            return ParsedReasoning("", "")  # maybe an opening `<think>` still coming
        body = text[len(START):] if text.startswith(START) else text
        end = body.find(END)
        if end >= 0:
            return ParsedReasoning(body[:end], body[end + len(END):])
        keep = len(body) if final else len(body) - held_back(body, END)
        return ParsedReasoning(body[:keep], "")


class Qwen3ReasoningParser(ReasoningParser):
    """qwen3: reasoning only in a reply that opens with `<think>`."""

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        if text.startswith(START):
            return super().parse(text, final)
        if not final and START.startswith(text):
            return ParsedReasoning("", "")  # maybe `<think>` still coming
        return ParsedReasoning("", text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"reasoning parser {name!r} is unknown; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}.") from None


class StreamingReasoning:
    """One streamed choice: `feed(delta, final)` -> (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser, self.text, self.sent = parser, "", (0, 0)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        reasoning = parsed.reasoning[self.sent[0]:]
        content = parsed.content[self.sent[1]:]
        self.sent = (max(self.sent[0], len(parsed.reasoning)),
                     max(self.sent[1], len(parsed.content)))
        return reasoning, content


def thinking_ended(prompt: str) -> bool:
    """Whether the prompt itself closes the reasoning (a template that switches thinking off
    writes an empty `<think></think>`), so a constraint applies from the first token."""
    return prompt.rfind(END) > prompt.rfind(START)
