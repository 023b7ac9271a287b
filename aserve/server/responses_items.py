"""The Responses API's request (`POST /v1/responses`, OpenAI's `CreateResponse`) and how it
becomes a chat request: its input items as chat messages, its function tools, tool choice and
`text.format` as the chat request's own fields.

    input item                       chat message
    string / {"role", "content"}     {"role", "content"} (developer → system)
    {"type": "function_call"}        an assistant message's tool call (consecutive calls, and a
                                     call after an assistant's text, join one message)
    {"type": "function_call_output"} {"role": "tool", "tool_call_id", "content"}
    {"type": "reasoning"}            dropped (templates render no past reasoning for a new turn)

The chat request then checks everything the chat route checks (`ChatCompletionRequest`), and
an error about one of its fields is reported under the Responses field the client wrote
(`as_responses_error`). No I/O, no engine here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from aserve.server.errors import ServerError, describe_validation_error
from aserve.server.fields import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    Int64,
    LogprobCount,
    PositiveInt,
    Temperature,
    TopP,
)
from aserve.server.protocol import ChatCompletionRequest
from aserve.server.structured import JsonSchema, StrictModel

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_INCLUDE = 32
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
# Fields of vLLM's sampling extras, passed to the chat request as they are (it checks them).
SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                   "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
                   "cache_salt", "priority")


class FunctionTool(StrictModel):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    model_config = {**StrictModel.model_config, "populate_by_name": True}

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format.schema is required for a format of type json_schema.")
        return self


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's models; changes nothing here


class ReasoningConfig(StrictModel):
    effort: str | None = None  # handed to the chat template as `reasoning_effort`
    summary: str | None = None  # (no summaries are made: reasoning comes back as its text)
    generate_summary: str | None = None


class ResponsesRequest(StrictModel):
    """`POST /v1/responses`. Fields that would change the result and are not supported are
    refused (conversation, prompt templates, max_tool_calls, tools other than functions,
    background with stream); the ones that change nothing here (service_tier, user,
    safety_identifier, prompt_cache_key, stream_options, verbosity) are ignored."""

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CHAT_MESSAGES)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: LogprobCount | None = None
    include: Annotated[list[str], Field(max_length=MAX_INCLUDE)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    metadata: dict[str, str] | None = None
    background: bool | None = False
    max_tool_calls: None = None
    conversation: None = None
    prompt: None = None
    seed: Int64 | None = None
    # vLLM's sampling extras (SAMPLING_EXTRAS): checked by the chat request they go to
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    logit_bias: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    cache_salt: Any = None
    priority: Any = None

    @model_validator(mode="after")
    def _background_is_stored_and_polled(self) -> ResponsesRequest:
        if self.background and self.store is False:
            raise ValueError("background: a background response is stored (it is polled with "
                             "GET /v1/responses/{id}); store: false cannot be combined with it.")
        if self.background and self.stream:
            raise ValueError("background: a streamed background response is not supported; "
                             "poll it with GET /v1/responses/{id} instead.")
        return self

    @field_validator("max_tool_calls", "conversation", "prompt", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server.")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_item(item, f"input.{i}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # (None, or not a list: the field's type refuses it)
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools.{i}.type: {kind!r} tools are not supported; this "
                                 "server runs function tools only.")
            try:
                FunctionTool.model_validate(tool)
            except ValidationError as e:
                message, param = describe_validation_error(e)
                raise ValueError(f"tools.{i}.{message}" if param else f"tools.{i}: {message}"
                                 ) from None
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(f"tool_choice: {value.get('type')!r} is not supported; give "
                             "none, auto, required or {'type': 'function', 'name': ...}.")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: Any) -> Any:
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} keys.")
        for key, text in (value or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} "
                                 f"characters and values at most {MAX_METADATA_VALUE_CHARS}.")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or ()]

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items, as OpenAI lists them back: a string is one user message, a
        message's string content one text part, every item typed."""
        if isinstance(self.input, str):
            return [_listed({"type": "message", "role": "user", "content": self.input})]
        return [_listed({"type": "message", **item} if "type" not in item else item)
                for item in self.input]

    def to_chat(self, history: list[dict[str, Any]], messages: list[dict[str, Any]]
                ) -> ChatCompletionRequest:
        """The chat request this one means: instructions as the system message, then the
        stored conversation before it (`history`), then `messages` (its input's). A 400 naming
        this request's own field for anything the chat request refuses."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fmt = self.text.format if self.text is not None else None
        fields: dict[str, Any] = {
            "messages": system + history + messages, "max_completion_tokens":
            self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "seed": self.seed, "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(fmt),
        }
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type"})} for t in self.function_tools()]
        if isinstance(self.tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {"type": "function",
                                     "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        fields |= {name: getattr(self, name) for name in SAMPLING_EXTRAS
                   if getattr(self, name) is not None}
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = describe_validation_error(e)
            raise as_responses_error(ServerError(message, 400, param)) from e


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_,
              "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                   if v is not None}}


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] != "message" or not isinstance(item.get("content"), str):
        return item
    kind = "output_text" if item["role"] == "assistant" else "input_text"
    return {**item, "content": [{"type": kind, "text": item["content"]}]}


def _check_item(item: Any, where: str) -> None:
    """One input item's shape, or a ValueError naming where it goes wrong."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: an input item must be an object.")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        if item.get("role") not in _ROLES:
            raise ValueError(f"{where}.role: must be one of {', '.join(_ROLES)}, got "
                             f"{item.get('role')!r}.")
        _content_text(item.get("content"), f"{where}.content")
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{where}.{key}: a function_call item needs a string {key}.")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ValueError(f"{where}.call_id: a function_call_output item needs a string "
                             "call_id.")
        _content_text(item.get("output"), f"{where}.output")
    elif kind == "item_reference":
        raise ValueError(f"{where}.type: item_reference is not supported; send the item "
                         "itself, or continue a stored response with previous_response_id.")
    elif kind != "reasoning":
        raise ValueError(f"{where}.type: unknown input item type {kind!r}; supported: "
                         "message, function_call, function_call_output, reasoning.")


def _content_text(content: Any, where: str) -> str:
    """A message's (or a tool output's) text: a string, or text parts joined; anything but
    text is refused, naming the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of content parts.")
    if len(content) > MAX_CONTENT_PARTS:
        raise ValueError(f"{where}: at most {MAX_CONTENT_PARTS} content parts, got "
                         f"{len(content)}.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in _TEXT_PARTS | {"refusal"} or not isinstance(text, str):
            raise ValueError(f"{where}.{j}: content part type {kind!r} is not supported; this "
                             "server takes text parts (input_text, output_text).")
        texts.append(text)
    return "\n".join(texts)


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked input items (`input_items`) as chat messages (module table)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": _ROLES[item["role"]],
                             "content": _content_text(item["content"], "content")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content_text(item["output"], "output")})
    return messages


# A chat request's field (path prefix) → the Responses field the client wrote.
_FIELD_NAMES = [
    (re.compile(r"^messages\b(\.\w+)*"), "input"),
    (re.compile(r"^max_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"^response_format\b(\.\w+)*"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function\b"), r"tools.\1"),
    (re.compile(r"^tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"^chat_template_kwargs\b(\.\w+)*"), "reasoning.effort"),
]


def as_responses_error(error: ServerError) -> ServerError:
    """`error`, about a chat request's field, renamed to the Responses request's field (its
    `param`, and the message where it starts with that field)."""
    for pattern, name in _FIELD_NAMES:
        if error.param and pattern.match(error.param):
            old, error.param = error.param, pattern.sub(name, error.param)
            if error.message.startswith(old):
                error.message = error.param + error.message[len(old):]
            break
    return error
