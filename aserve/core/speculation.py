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

    def propose(self, req_id: str, token_ids: list[int], max_drafts: int | None = None
                ) -> list[int]:
        """Up to min(k, max_drafts) drafts to follow `token_ids` (request `req_id`'s); [] when
        no suffix of min_n .. max_n tokens occurred before."""
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

    def observe(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Drafts a runner proposed (a draft model's): none here."""

    def finish(self, req_id: str, output_token_ids: list[int]) -> None:
        """Nothing to forget: the lookup keeps no state between steps."""



class SuffixProposer:
    """Suffix decoding (Oliaro et al. 2024, as vLLM's `method: suffix` runs it): drafts from
    the longest suffix of a request's tokens that occurred before, in its own prompt and output
    or in the outputs of recent requests, continued by the most frequent next token among all
    of that suffix's occurrences, for as long as the path's estimated probability stays at or
    above `min_token_prob`, and for at most `max_spec_factor` x the match's length tokens.

    Two indexes of the same kind: the positions every pair of consecutive tokens ends at
    (a request's own, built as its tokens come; and the cache's, over the outputs of the last
    `max_cached_requests` finished requests). A query takes the positions of its last two
    tokens, extends each match backwards up to `max_tree_depth` tokens, keeps the longest, and
    walks their continuations forward: no tree is built, and a step costs O(occurrences x
    depth) over at most `MAX_OCCURRENCES` recent occurrences per index.

    Memory is bounded whatever the clients send (about 120 bytes an indexed token): a
    request's index covers its last `WINDOW` tokens (rebuilt from them once it spans twice
    that), and the cache holds `MAX_CACHED_TOKENS` output tokens at most."""

    MAX_OCCURRENCES = 32  # most recent occurrences of a token pair a query looks at
    WINDOW = 4096  # a request's tokens its own index covers (the latest)
    MAX_CACHED_TOKENS = 1 << 18  # output tokens the cache holds at most, over its requests

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        # req id -> (first position indexed, tokens indexed, token pair -> the positions it
        # ends at)
        self._own: dict[str, tuple[int, int, dict[tuple[int, int], list[int]]]] = {}
        self._cache: dict[int, list[int]] = {}  # cache id -> output tokens, oldest first
        self._cache_index: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._cache_tokens = 0
        self._next_id = 0

    def propose(self, req_id: str, token_ids: list[int], max_drafts: int | None = None
                ) -> list[int]:
        """Up to min(k, max_drafts) drafts to follow `token_ids`, request `req_id`'s."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        if k <= 0 or len(token_ids) < 2:
            return []
        tokens, index = self._own_index(req_id, token_ids)
        key = (token_ids[-2], token_ids[-1])
        # (sequence, end): sequence[end - 2:end] == key, end < len(sequence) (a continuation)
        found = [(tokens, end) for end in index.get(key, ())[-self.MAX_OCCURRENCES:]
                 if end < len(token_ids)]
        found += [(self._cache[c], end) for c, end in
                  self._cache_index.get(key, ())[-self.MAX_OCCURRENCES:] if c in self._cache]
        if not found:
            return []
        lengths = [self._match_length(seq, end, token_ids) for seq, end in found]
        longest = max(lengths)
        matches = [m for m, n in zip(found, lengths, strict=True) if n == longest]
        limit = min(k, max(1, int(self.spec_factor * longest)))
        drafts: list[int] = []
        prob = 1.0
        while len(drafts) < limit:
            step = len(drafts)
            following: dict[int, int] = {}
            for seq, end in matches:
                if end + step < len(seq):
                    token = seq[end + step]
                    following[token] = following.get(token, 0) + 1
            if not following:
                break
            token, count = max(following.items(), key=lambda item: item[1])
            prob *= count / sum(following.values())
            if prob < self.min_prob:
                break
            drafts.append(token)
            matches = [(seq, end) for seq, end in matches
                       if end + step < len(seq) and seq[end + step] == token]
        return drafts

    def _match_length(self, seq: list[int], end: int, token_ids: list[int]) -> int:
        """How many tokens before `end` in `seq` equal the last ones of `token_ids` (2 at
        least: the pair indexed), up to the depth."""
        n, limit = 2, min(self.depth, end, len(token_ids))
        while n < limit and seq[end - 1 - n] == token_ids[-1 - n]:
            n += 1
        return n

    def _own_index(self, req_id: str, token_ids: list[int]
                   ) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
        """The request's pair index, brought up to its tokens (which only grow: a preempted
        request keeps them), and the tokens themselves."""
        start, indexed, index = self._own.get(req_id, (0, 0, {}))
        if len(token_ids) - start > 2 * self.WINDOW:  # drop what left the window
            start = indexed = len(token_ids) - self.WINDOW
            index = {}
        for end in range(max(start + 2, indexed + 1), len(token_ids) + 1):
            index.setdefault((token_ids[end - 2], token_ids[end - 1]), []).append(end)
        self._own[req_id] = (start, len(token_ids), index)
        return token_ids, index

    def observe(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Drafts a runner proposed (a draft model's): none here."""

    def finish(self, req_id: str, output_token_ids: list[int]) -> None:
        """The request ends: forget its index; its output joins the cache (the oldest
        leave it past max_cached_requests or MAX_CACHED_TOKENS)."""
        self._own.pop(req_id, None)
        if self.max_cached <= 0 or len(output_token_ids) < 3:
            return
        output = list(output_token_ids[-self.MAX_CACHED_TOKENS:])
        cache_id, self._next_id = self._next_id, self._next_id + 1
        self._cache[cache_id] = output
        self._cache_tokens += len(output)
        for end in range(2, len(output)):
            self._cache_index.setdefault((output[end - 2], output[end - 1]), []).append(
                (cache_id, end))
        while len(self._cache) > self.max_cached or self._cache_tokens > self.MAX_CACHED_TOKENS:
            oldest = next(iter(self._cache))
            self._cache_tokens -= len(self._cache.pop(oldest))
        if sum(map(len, self._cache_index.values())) > 2 * (self._cache_tokens + 1024):
            self._cache_index = {key: kept for key, ends in self._cache_index.items()
                                 if (kept := [(c, e) for c, e in ends if c in self._cache])}


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's steps may carry drafts: its every token is then drawn from the
    target's distribution after logit bias, the min_tokens mask, temperature, top-k, top-p and
    min-p and the penalties (each row counting the drafts before it as output), which
    `verify_drafts` reproduces exactly; logprobs, of the raw logits, come from the same rows.
    A grammar's rows are masked by the grammar after the drafts before them (a draft it
    refuses has probability 0: rejected). Random sampling with a seed decodes a token a step
    as before: its draws follow (seed, position), and the drafts a step carries depend on the
    batch (its budget, the cost policy), so speculating would tie its tokens to the batch."""
    return params.seed is None or params.temperature == 0.0


def max_drafts_before_min_tokens(num_output_tokens: int, min_tokens: int) -> int | None:
    """Below min_tokens, drafts stop short of it: every row of the step then predicts a
    position below it, masked as the request's state says (the sampler masks a step's rows
    by the count before the step). None: no limit."""
    if num_output_tokens >= min_tokens:
        return None
    return min_tokens - num_output_tokens - 1


# The lowest a request's acceptance estimate counts as (below it a request would stop
# drafting for good: it still drafts one or two tokens while steps are cheap, and recovers
# if its text starts repeating). A request none of whose drafts were verified yet counts as
# accepting all: it drafts as much as pays once, and its own rate decides from then on.
MIN_ACCEPTANCE = 0.1
# A step that verifies none of a request's drafts moves its acceptance estimate this far back
# toward the prior (1): a request that stopped drafting on a bad start (a draft model or head
# whose passes cost enough that a low estimate never pays) drafts again within a few steps,
# and its verifications decide anew.
ACCEPTANCE_RELAX = 0.02


def worthwhile_drafts(k: int, acceptance: float, fixed_cost_tokens: float | None,
                      num_decoding: int, pass_tokens: float = 0.0) -> int:
    """How many of k drafts are worth their cost in a step of `num_decoding` decodes, by the
    step-cost model (`step_cost.py`: a step costs a + b * tokens, F = a / b).

    Draft j (1-based) is accepted with probability ~acceptance^j and costs one token, b. A
    token is worth what a step without drafts spends on each of its tokens, (a + b D) / D. So
    draft j pays while acceptance^j * (F + D) > D: always while a step is mostly its fixed cost
    (few decodes against F), never once D is large beside F (the step is compute-bound, and
    speculation would cost throughput). F unknown (no fit yet): all k.

    A draft model's pass j also costs its time, shared by the step's D requests: in tokens of
    the fit (`pass_tokens`, its seconds / b), draft j pays while acceptance^j (F + D) > D +
    pass_tokens."""
    if fixed_cost_tokens is None or num_decoding <= 0:
        return k
    alpha = min(max(acceptance, MIN_ACCEPTANCE), 0.999)
    ratio = (num_decoding + pass_tokens) / (fixed_cost_tokens + num_decoding)
    if ratio >= 1:
        return 0
    return max(0, min(k, math.ceil(math.log(ratio) / math.log(alpha)) - 1))


class RunnerDrafts:
    """The drafts of the `draft_model`, `eagle` and `eagle3` methods: proposed by the runner's
    draft model or EAGLE head after each step (`runner/spec_draft.py`, `runner/spec_eagle.py`,
    in `ModelRunnerOutput.draft_token_ids`); the scheduler keeps what the next step can
    carry, as for its own lookups."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self._latest: dict[str, list[int]] = {}

    def observe(self, draft_token_ids: dict[str, list[int]]) -> None:
        self._latest = draft_token_ids

    def propose(self, req_id: str, token_ids: list[int], max_drafts: int | None = None
                ) -> list[int]:
        drafts = self._latest.get(req_id, [])
        return list(drafts[:self.k if max_drafts is None else min(self.k, max_drafts)])

    def finish(self, req_id: str, output_token_ids: list[int]) -> None:
        """Nothing to forget: drafts live one step."""


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer | RunnerDrafts:
    if config.runner_drafts:
        return RunnerDrafts(config)
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)
