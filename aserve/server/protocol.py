"""The OpenAI wire protocol: request models of `/v1/completions`, `/v1/chat/completions`,
`/tokenize` and `/detokenize` (responses are in `responses.py`; the field types, limits and
shape checks in `fields.py`).

Requests are checked here — types (strictly: `"ten"` is not a number, but `5.0` is the integer 5,
as JSON Schema and so `/openapi.json` say), ranges, features we do not support, and the size
limits below that bound what one request may ask of the server (beyond
`max_request_body_bytes`) — so a route gets either a well-formed request or a
`pydantic.ValidationError` to answer with 400 naming the field; `to_sampling_params` then maps
one onto `SamplingParams`. Unknown fields are ignored, as OpenAI's SDK users expect of
`extra_body`. Responses serialise with a plain `model_dump()` to the JSON the `openai` SDK
parses. Names, defaults and extras follow OpenAI's API and vLLM's server.

No I/O, no engine and no tokenizer here: the logprob helpers take a `decode` callable.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from aserve.sampling_params import SamplingParams
from aserve.server.fields import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID_DIGITS,
    MAX_TOTAL_CHOICES,
    Bias,
    CacheSalt,
    Int64,
    LogprobCount,
    NonNegativeInt,
    Penalty,
    PositiveInt,
    PromptInput,
    StopInput,
    Temperature,
    TokenId,
    TopP,
    WholeNumber,
    _check_prompt_shape,
    _check_stop,
    _is_single_prompt,
)
from aserve.server.structured import StrictModel, StructuredOutputFields
from aserve.server.tools import ToolCall, ToolFields, template_tool_calls


def make_id(prefix: str) -> str:
    """A fresh response id: `cmpl-…`, `chatcmpl-…`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_now() -> int:
    return int(time.time())


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ---------------------------------------------------------------------------------------------
# Requests


_Request = StrictModel


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _GenerationRequest(StructuredOutputFields):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras; the
    structured-output ones in `structured.py`)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), WholeNumber] | None = 1
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopInput | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: Annotated[dict[str, Bias], Field(
        max_length=MAX_LOGIT_BIAS,
        json_schema_extra={"propertyNames": {"pattern": f"^[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$"}},
    )] | None = None
    seed: Int64 | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1), WholeNumber] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    prompt_logprobs: LogprobCount | None = None
    # vLLM's: the prompt's cached blocks are shared only with requests of the same salt
    cache_salt: CacheSalt | None = None
    # Disaggregated prefill (vLLM's): what the server's KV connector reads of this request,
    # checked against it (no connector, or keys it does not know: a 400)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_is_strings(cls, value: Any) -> Any:
        if value is not None:
            _check_stop(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, value: Any) -> Any:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys must be token ids (strings of non-negative "
                                 f"integers), got {key[:MAX_TOKEN_ID_DIGITS + 1]!r}.")
        return value

    @model_validator(mode="after")
    def _remote_decode_is_not_streamed(self) -> _GenerationRequest:
        if self.stream and (self.kv_transfer_params or {}).get("do_remote_decode"):
            raise ValueError("kv_transfer_params.do_remote_decode needs stream=false: the "
                             "kv_transfer_params a consumer needs come back in the response.")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        """Whether every stream chunk carries usage so far."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def _sampling_kwargs(self) -> dict[str, Any]:
        bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        return dict(
            n=_or(self.n, 1), temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=-1 if self.top_k in (None, 0) else self.top_k, min_p=_or(self.min_p, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0), seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=bias,
            structured_outputs=self.structured_outputs_params(),
            kv_transfer_params=self.kv_transfer_params)


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`."""

    prompt: PromptInput
    echo: bool | None = False  # (before max_tokens, whose check reads it)
    max_tokens: NonNegativeInt | None = 16  # 0: with echo, the prompt scored, nothing made
    logprobs: LogprobCount | None = None
    suffix: None = None  # unsupported: refused (the types here say so to the OpenAPI schema)
    best_of: PositiveInt | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        _check_prompt_shape(value)
        return value

    @field_validator("prompt")
    @classmethod
    def _total_choices(cls, value: Any, info: ValidationInfo) -> Any:
        n = _or(info.data.get("n"), 1)
        num_prompts = 1 if _is_single_prompt(value) else len(value)
        if n * num_prompts > MAX_TOTAL_CHOICES:
            raise ValueError(f"prompt: {num_prompts} prompts with n={n} ask for "
                             f"{n * num_prompts} choices; at most {MAX_TOTAL_CHOICES} are "
                             "allowed per request.")
        return value

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("suffix is not currently supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value != _or(info.data.get("n"), 1):
            raise ValueError(f"best_of must be unset or equal to n; best_of={value} with "
                             f"n={_or(info.data.get('n'), 1)} is not supported.")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_to_score(cls, value: Any, info: ValidationInfo) -> Any:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be greater than 0, or 0 with echo (the prompt "
                             "echoed and scored, nothing generated)")
        if value == 0 and _or(info.data.get("min_tokens"), 0) > 0:
            raise ValueError(f"max_tokens=0 is less than min_tokens="
                             f"{info.data.get('min_tokens')}")
        return value

    @property
    def scores_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt and its logprobs, no completion (the
        engine decodes the one token its prefill gives, which the response leaves out)."""
        return self.max_tokens == 0

    @model_validator(mode="after")
    def _kv_transfer_params_for_one_prompt(self) -> CompletionRequest:
        if self.kv_transfer_params is not None and not _is_single_prompt(self.prompt):
            raise ValueError("kv_transfer_params works with a single prompt only.")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per entry: text or token ids."""
        prompt = self.prompt
        if _is_single_prompt(prompt):
            return [prompt]
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        """max_tokens null stays None: the engine fills in what the context leaves. Raises
        `ValueError` naming the field for values `SamplingParams` rejects."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs  # echoed prompt tokens get logprobs too
        kwargs = self._sampling_kwargs() | dict(prompt_logprobs=prompt_logprobs)
        return SamplingParams(**kwargs, max_tokens=1 if self.scores_only else self.max_tokens,
                              logprobs=self.logprobs)


Messages = Annotated[list["ChatMessage"], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


ContentParts = Annotated[list[TextContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class ChatMessage(_Request):
    """One message of a conversation; content is text or a list of text parts."""

    role: str
    content: str | ContentParts | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts.")
        if len(value) > MAX_CONTENT_PARTS:
            raise ValueError(f"content may hold at most {MAX_CONTENT_PARTS} parts, "
                             f"got {len(value)}.")
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported; only "
                                 "{'type': 'text', 'text': ...} parts are.")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string `text`.")
        return value

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def to_template(self, arguments_as_text: bool = False) -> dict[str, Any]:
        """This message as a chat template sees it: role, content (a string), name, tool calls
        (arguments as objects, or as the JSON text they came as) and tool_call_id where
        given."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls, arguments_as_text)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_GenerationRequest, ToolFields):
    """`POST /v1/chat/completions`."""

    messages: Messages
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    continue_final_message: Literal[False] = False
    add_special_tokens: bool = False
    echo: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return value

    @field_validator("continue_final_message", mode="before")
    @classmethod
    def _no_continue_final_message(cls, value: Any) -> Any:
        if value:
            raise ValueError("continue_final_message is not supported yet.")
        return value

    def to_sampling_params(self) -> SamplingParams:
        """max_completion_tokens wins over max_tokens; both null → None (the engine fills in
        what the context leaves). Raises `ValueError` naming the field for values
        `SamplingParams` rejects."""
        max_tokens = _or(self.max_completion_tokens, self.max_tokens)
        logprobs = _or(self.top_logprobs, 0) if self.logprobs else None
        kwargs = self._sampling_kwargs()
        tool_constraint = self.tool_constraint()
        if tool_constraint is not None:
            if kwargs["structured_outputs"] is not None:
                raise ValueError(f"tool_choice {self.tool_mode} constrains the reply already; "
                                 "it cannot be combined with response_format or "
                                 "structured_outputs.")
            kwargs["structured_outputs"] = tool_constraint
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)

    def template_messages(self, arguments_as_text: bool = False) -> list[dict[str, str]]:
        """The messages as the chat template takes them (content flattened to a string; tool
        calls' arguments as objects, or as text: `ChatMessage.to_template`)."""
        return [m.to_template(arguments_as_text) for m in self.messages]

    @property
    def has_tool_history(self) -> bool:
        return any(m.tool_calls for m in self.messages)


class TokenizeRequest(_Request):
    """`POST /tokenize`: either `prompt` (add_special_tokens defaults to True) or `messages`
    rendered by the chat template (add_special_tokens defaults to False)."""

    model_config = ConfigDict(**_Request.model_config, json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Give exactly one of `prompt` and `messages`.")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None
        return self

    def template_messages(self, arguments_as_text: bool = False) -> list[dict[str, str]]:
        return [m.to_template(arguments_as_text) for m in self.messages or []]

    @property
    def has_tool_history(self) -> bool:
        return any(m.tool_calls for m in self.messages or [])


class DetokenizeRequest(_Request):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[TokenId]
