"""The OpenAI wire protocol's responses: completion / chat objects and stream chunks, models,
tokenize / detokenize, usage, and the two shapes of logprobs. A plain `model_dump()` gives the
JSON the `openai` SDK parses. (Requests live in `protocol.py`.)

No I/O, no engine and no tokenizer here: the logprob helpers take a `decode` callable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from aserve.engine.outputs import Logprob
from aserve.server.protocol import make_id, unix_now
from aserve.server.tools import ToolCall

MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry

# ---------------------------------------------------------------------------------------------
# Responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """Completions' `logprobs`: one entry per token; None where a token has no logprob (the
    first prompt token when echoing)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """A choice of a completion; in a stream chunk `text` is the new text only."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    # A KV producer's answer (what a consumer needs to load this prompt's K/V); else None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float = MIN_LOGPROB
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> part
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # as CompletionResponse's


class DeltaMessage(BaseModel):
    """A stream chunk's `delta`; unset fields are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # [{index, id?, type?, function: {name?, arguments?}}]: a call's first chunk has its id and
    # name, the later ones pieces of its arguments
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


def chat_role_chunk(response_id: str, model: str, created: int,
                    index: int) -> ChatCompletionStreamResponse:
    """The first chunk of choice `index`: `delta` = {role: assistant, content: ""}."""
    choice = ChatCompletionStreamChoice(index=index,
                                        delta=DeltaMessage(role="assistant", content=""))
    return ChatCompletionStreamResponse(id=response_id, model=model, created=created,
                                        choices=[choice])


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "aserve"
    root: str | None = None
    max_model_len: int | None = None
    quantization: str | None = None  # what runs quantized, and how (None: float weights)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------------------------
# Logprobs: the engine's `dict[token_id, Logprob]` per token → OpenAI's two shapes


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _token_text(token_id: int, logprob: Logprob | None, decode: Callable[[int], str]) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def _ranked(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """Entries best first: by rank where known, else by logprob."""
    return sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0,
                                                -kv[1].logprob))


def completion_logprobs(token_ids: Sequence[int],
                        sample_logprobs: Sequence[dict[int, Logprob] | None],
                        decode: Callable[[int], str],
                        initial_offset: int = 0) -> CompletionLogprobs:
    """The completions `logprobs` object for `token_ids`, whose text starts at character
    `initial_offset` of the choice's text (nonzero in stream chunks after the first, or after an
    echoed prompt). `top_logprobs` holds every entry the engine gave: the top-k and the chosen
    token."""
    out = CompletionLogprobs()
    offset = initial_offset
    for token_id, step in zip(token_ids, sample_logprobs, strict=True):
        chosen = step.get(token_id) if step else None
        token = _token_text(token_id, chosen, decode)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(chosen.logprob))
        out.top_logprobs.append({_token_text(t, lp, decode): _clamp(lp.logprob)
                                 for t, lp in _ranked(step)})
    return out


def _chat_logprob(token: str, logprob: float) -> ChatLogprob:
    return ChatLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(token_ids: Sequence[int],
                  sample_logprobs: Sequence[dict[int, Logprob] | None],
                  decode: Callable[[int], str],
                  num_top_logprobs: int) -> ChatChoiceLogprobs:
    """The chat `logprobs` object: per token its text, logprob, UTF-8 bytes and the
    `num_top_logprobs` most likely tokens at that position."""
    content = []
    for token_id, step in zip(token_ids, sample_logprobs, strict=True):
        chosen = step.get(token_id) if step else None
        top = [_chat_logprob(_token_text(t, lp, decode), lp.logprob)
               for t, lp in _ranked(step or {})[:num_top_logprobs]]
        entry = _chat_logprob(_token_text(token_id, chosen, decode),
                              chosen.logprob if chosen else MIN_LOGPROB)
        content.append(ChatTokenLogprob(**entry.model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
