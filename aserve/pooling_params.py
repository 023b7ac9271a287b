"""`PoolingParams`: how one pooling request (an embedding) turns the final hidden states of its
prompt into one vector. Shaped like vLLM's; torch-free, checked at construction.

A pooling request is prefill only: the runner pools the final-norm hidden states of its prompt
(`runner/pooler.py`) and nothing is sampled. What the request leaves unset (`pooling_type`,
`normalize`) is the model's (`config.PoolerConfig`), filled in by the engine's processor.
"""

from __future__ import annotations

from dataclasses import dataclass

# LAST: the last prompt token's hidden state; MEAN: the mean over every prompt token's;
# CLS: the first token's
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    # None: the model's (sentence-transformers' `1_Pooling/config.json`, else LAST)
    pooling_type: str | None = None
    # L2-normalise the vector (after `dimensions`); None: the model's (its Normalize module;
    # True for a decoder without sentence-transformers config, as vLLM)
    normalize: bool | None = None
    # Matryoshka: keep the first `dimensions` values (before normalising); None: all
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                 f"got {self.pooling_type!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}.")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")

    @property
    def needs_every_token(self) -> bool:
        """Whether the vector reads hidden states of tokens a prefix hit would skip (MEAN, CLS):
        such a request computes its whole prompt (no prefix-cache hit). LAST pools the last
        token, which a hit never covers."""
        return self.pooling_type != "LAST"
