"""The pooling routes' wire protocol (`pooling.py`): `/v1/embeddings` (OpenAI's, with vLLM's
extras), `/v1/score` (vLLM's) and `/rerank` (Jina's and Cohere's shape, as vLLM serves it).

Requests are checked as the generation routes' are (`protocol.py`, `fields.py`): strict types,
bounded counts (at most `MAX_PROMPTS` inputs, texts or documents), each violation a 400
naming the field; responses serialise with `model_dump()` to what the `openai` SDK (and Jina's /
Cohere's clients) parse. No I/O here.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from aserve.pooling_params import PoolingParams
from aserve.server.fields import (
    MAX_PROMPTS,
    Int64,
    NonNegativeInt,
    PositiveInt,
    PromptInput,
    _check_prompt_shape,
)
from aserve.server.protocol import make_id, unix_now
from aserve.server.structured import StrictModel

Texts = str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]


class EmbeddingRequest(StrictModel):
    """`POST /v1/embeddings`."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None  # Matryoshka: the first N values, then normalised
    user: str | None = None  # (accepted, unused)
    # vLLM's extras
    normalize: bool | None = None  # None: the model's (its Normalize module)
    add_special_tokens: bool = True
    priority: Int64 = 0

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        try:
            _check_prompt_shape(value)
        except ValueError as e:
            raise ValueError(str(e).replace("prompt", "input", 1)) from None
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a text or a token-id list."""
        value = self.input
        return [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(normalize=self.normalize, dimensions=self.dimensions)


class ScoreRequest(StrictModel):
    """`POST /v1/score` (and `/score`): text_1 against each of text_2 (1 ↔ N), or the i-th
    against the i-th (N ↔ N); a score is the cosine of the two texts' embeddings."""

    model: str | None = None
    text_1: Texts
    text_2: Texts
    priority: Int64 = 0

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _texts_shape(cls, value: Any, info: ValidationInfo) -> Any:
        texts = [value] if isinstance(value, str) else value
        if not (isinstance(texts, list) and 0 < len(texts) <= MAX_PROMPTS
                and all(isinstance(t, str) for t in texts)):
            raise ValueError(f"{info.field_name} must be a string or a list of 1 to "
                             f"{MAX_PROMPTS} strings.")
        return value


class RerankDocument(StrictModel):
    text: str


class RerankRequest(StrictModel):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: the documents ordered by the cosine of
    their embedding with the query's."""

    model: str | None = None
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1,
                                                           max_length=MAX_PROMPTS)]
    top_n: NonNegativeInt | None = None  # None or 0: every document
    return_documents: bool = True
    priority: Int64 = 0

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


# ---------------------------------------------------------------------------------------------
# Responses


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: little-endian float32 bytes, as OpenAI's
    index: int

    @classmethod
    def of(cls, vector: np.ndarray, index: int, encoding_format: str) -> EmbeddingData:
        if encoding_format == "base64":
            data = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            return cls(embedding=data, index=index)
        return cls(embedding=vector.tolist(), index=index)


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankUsage(BaseModel):
    total_tokens: int = 0


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None  # with return_documents
    relevance_score: float


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
