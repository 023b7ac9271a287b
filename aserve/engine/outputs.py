"""What the engine hands back to users: `RequestOutput`, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append the delta that came after this one (their tokens, text and logprobs)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # A KV producer's answer once finished (what a consumer needs to load this prompt's K/V:
    # vLLM's `kv_transfer_params`); None otherwise
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, later: RequestOutput) -> None:
        """Merge the delta that came after this one into it, as if they had come as one: a
        stream's reader that falls behind then finds one output, not one per step."""
        by_index = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            if completion.index in by_index:
                by_index[completion.index].add(completion)
            else:
                self.outputs.append(completion)
                by_index[completion.index] = completion
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        if later.kv_transfer_params is not None:
            self.kv_transfer_params = later.kv_transfer_params


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's `PoolingOutput`): `data`, float32 numpy [D]."""

    data: Any

    @property
    def embedding(self) -> list[float]:
        """The vector as floats (vLLM's `EmbeddingOutput.embedding`)."""
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """What a pooling request gives back once (`LLM.embed`, the embeddings route): its
    prompt's vector; `outputs` None when it was aborted before it was pooled."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    num_cached_tokens: int = 0

    def add(self, later: PoolingRequestOutput) -> None:
        """(`RequestStream`'s merge: a pooling request has one output, the later wins.)"""
        self.outputs, self.finished = later.outputs, later.finished


@dataclass
class ScoringOutput:
    score: float  # the cosine similarity of the two texts' embeddings


@dataclass
class ScoringRequestOutput:
    """One pair's score (`LLM.score`, vLLM's shape): `outputs.score`; the token ids of both
    texts, the first's then the second's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
