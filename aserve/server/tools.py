"""Tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls`, what they make
the model generate, and how its text becomes `tool_calls`.

    tool_choice     generation                                    the text is
    none            free (tools still shown to the chat template) content
    required        constrained: a JSON array of {name, parameters}   the calls
    {function}      constrained: the named function's arguments   that call's arguments
    auto (default   free text; from the format's trigger on, each    content and calls, read by
    with tools)     call constrained to its tool's schema            the model's format's parser
                                                                  (`tool_parsers/`)

Every call is enforced by a grammar (auto: where the format has `call_patterns`), so its
arguments are valid JSON of the function's schema even from a weak model. One truncation rule,
streamed or not: a call cut off by `max_tokens` is never reported as a call; its text is
content and `finish_reason` is "length" (`tool_replies.py`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from aserve.sampling_params import StructuredOutputsParams
from aserve.server.structured import StrictModel


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments", mode="before")
    @classmethod
    def _object_as_json(cls, value: Any) -> Any:
        """History from clients that send the arguments as an object (not OpenAI's string):
        taken as its JSON text."""
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCall(StrictModel):
    """An assistant message's tool call, in a conversation's history (or a reply)."""

    id: str = Field(default_factory=lambda: make_tool_call_id())
    type: Literal["function"] = "function"
    function: FunctionCall


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(StrictModel):
    """Mixed into the chat request."""

    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @model_validator(mode="after")
    def _choice_fits_tools(self) -> ToolFields:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or ()]
        if not names and choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools: the request gives none.")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is "
                             f"not among the tools ({', '.join(names)}).")
        return self

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def tool_constraint(self, patterns: list | None = None, any_whitespace: bool = False
                        ) -> StructuredOutputsParams | None:
        """The grammar the reply's calls generate under: `required` and named choices' JSON;
        for auto, free text in which the format's trigger starts a call held to one of
        `patterns` (the parser's `CallPattern`s for these tools: vLLM's structural tag),
        its arguments compact JSON unless `any_whitespace`. None: unconstrained."""
        mode = self.tool_mode
        if mode == "auto" and patterns:
            options = {"x-guidance": {"whitespace_flexible": any_whitespace}}
            structures = [{"begin": p.begin, "end": p.end, **(
                {"grammar": p.grammar} if p.grammar is not None
                else {"schema": {**p.schema, **options}})} for p in patterns]
            return StructuredOutputsParams(structural_tag={
                "structures": structures, "triggers": sorted({p.trigger for p in patterns})})
        if mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return StructuredOutputsParams(json=_parameters(tool))
        if mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in self.tools]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if self.parallel_tool_calls is False:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template's `tools` variable takes them (transformers' shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def template_tool_calls(calls: list[ToolCall], arguments_as_text: bool = False
                        ) -> list[dict[str, Any]]:
    """A history message's tool calls for a chat template: arguments as an object (the shape
    most templates index into, as vLLM hands them over), or `arguments_as_text`, the JSON text
    they came as (for templates that join them into the prompt as a string: DeepSeek-V3.1's
    official one). Arguments that are not JSON stay text either way."""
    out = []
    for call in calls:
        try:
            arguments: Any = (call.function.arguments if arguments_as_text
                              else json.loads(call.function.arguments))
        except (json.JSONDecodeError, RecursionError):
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out
