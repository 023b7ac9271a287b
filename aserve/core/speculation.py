"""Speculative decoding's scheduler side (docs/design.md §8, "Speculative decoding"): after
each step the scheduler asks the proposer for drafts to follow a request's tokens, gives the
request 1 + drafts tokens the next step (KV slots included), and keeps the drafts the runner
verified (`runner/spec_verify.py`) as its tokens; the rest of the step is rolled back.

`NgramProposer`: prompt-lookup drafts. The sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) are looked for earlier in the same sequence
(prompt and output); at the latest earlier match, the tokens that followed it are the drafts:

    tokens   ... the cat sat on the mat . the cat sat
    suffix (n = 3)                            the cat sat
    match        the cat sat                 -> drafts: on the mat (k = 3)

Replies that quote or edit their input (code edits, JSON conversions, tool arguments) repeat
long runs of it, and every run after its first n tokens is drafted whole. The scan is numpy
over the last `window` tokens: O(window x n) a request and step, well under a millisecond at
a few thousand tokens."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from aserve.config import SpeculativeConfig
from aserve.sampling_params import SamplingParams


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, window: int = 8192) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.window = window

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) drafts to follow `token_ids`; [] when no suffix of
        min_n .. max_n tokens occurred before."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-self.window:], dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # starts i of earlier occurrences: tokens[i:i + n] == the suffix, i + n < length
            windows = sliding_window_view(tokens[:-1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


def can_speculate(params: SamplingParams, has_grammar: bool) -> bool:
    """Whether a request's steps may carry drafts: its every token is then drawn from the
    target's distribution after logit bias, the min_tokens mask, temperature, top-k, top-p and
    min-p and the penalties (each row counting the drafts before it as output), which
    `verify_drafts` reproduces exactly; logprobs, of the raw logits, come from the same rows.
    Random sampling with a seed decodes a token a step as before: its draws follow (seed,
    position), and the drafts a step carries depend on the batch (its budget, the cost
    policy), so speculating would tie its tokens to the batch. So does a grammar's request
    (its drafts would have to be checked against the grammar: a later session)."""
    return not has_grammar and (params.seed is None or params.temperature == 0.0)


def max_drafts_before_min_tokens(num_output_tokens: int, min_tokens: int) -> int | None:
    """Below min_tokens, drafts stop short of it: every row of the step then predicts a
    position below it, masked as the request's state says (the sampler masks a step's rows
    by the count before the step). None: no limit."""
    if num_output_tokens >= min_tokens:
        return None
    return min_tokens - num_output_tokens - 1


# The acceptance a request starts from, before its own drafts are verified, and the lowest
# a request's estimate goes (below it a request would stop drafting for good: it still
# drafts one or two tokens while steps are cheap, and recovers if its text starts repeating)
PRIOR_ACCEPTANCE = 0.5
MIN_ACCEPTANCE = 0.1


def worthwhile_drafts(k: int, acceptance: float, fixed_cost_tokens: float | None,
                      num_decoding: int) -> int:
    """How many of k drafts are worth their cost in a step of `num_decoding` decodes, by the
    step-cost model (`step_cost.py`: a step costs a + b * tokens, F = a / b).

    Draft j (1-based) is accepted with probability ~acceptance^j and costs one token, b. A
    token is worth what a step without drafts spends on each of its tokens, (a + b D) / D. So
    draft j pays while acceptance^j * (F + D) > D: always while a step is mostly its fixed cost
    (few decodes against F), never once D is large beside F (the step is compute-bound, and
    speculation would cost throughput). F unknown (no fit yet): all k."""
    if fixed_cost_tokens is None or num_decoding <= 0:
        return k
    alpha = min(max(acceptance, MIN_ACCEPTANCE), 0.999)
    ratio = num_decoding / (fixed_cost_tokens + num_decoding)  # < 1
    return max(0, min(k, math.ceil(math.log(ratio) / math.log(alpha)) - 1))
