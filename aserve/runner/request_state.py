"""The runner's own copy of one running request (docs/design.md §4): tokens and sampling (its
blocks: a row of the runner's `BlockTables`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams
from aserve.structured_output import CompiledGrammar, GrammarMatcher


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int  # (its block ids: a row of the runner's `BlockTables`)
    output_token_ids: list[int] = field(default_factory=list)
    # The engine's (`core.Request`): the ids that end it (its stop_token_ids, and EOS unless
    # ignore_eos), and its constraint compiled for the model's tokenizer
    stop_token_ids: frozenset[int] = frozenset()
    compiled_grammar: CompiledGrammar | None = None
    # A pooling request's (the pooling runner's), and what its earlier chunks left for the
    # pooler (`runner/pooler.py`: MEAN's running sum, CLS's first row), on the device
    pooling_params: PoolingParams | None = None
    pooling_partial: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        # A constrained request's place in its grammar, replayed over the tokens it has (a
        # preempted request resumes here with them all)
        compiled = self.compiled_grammar
        self.grammar = (GrammarMatcher(compiled, self.output_token_ids)
                        if compiled is not None else None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_below_min_tokens(self) -> bool:
        """Fewer outputs than `min_tokens`: its stop tokens may not be sampled yet (the
        sampler's mask holds them back, or for a constrained row its token bitmask)."""
        return len(self.output_token_ids) < self.sampling_params.min_tokens

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)
