"""`GrammarMasks`: the constrained sampling rows of each step (docs/design.md, "Structured
outputs") — which are masked before sampling and which are checked after, their token bitmasks
filled beside the forward, and the min_tokens rule of constrained rows. Not the grammars
themselves (`aserve/structured_output`) nor the sampling (`sampler.py`).

    start(rows)              constrained rows ─ "ahead": bitmask filled on "aserve-grammar" ┐
                                            └ "checked": nothing yet                        │
    (forward)                                                                               │
    apply(logits, masks)     ahead rows: one masked copy of the logits ◄────────────────────┘
    (sampler)
    check(rows, ..., masks)  checked rows: a token the grammar refuses (or a held stop token)
                             → the argmax of the row's allowed tokens instead

A row short of its `min_tokens` holds its stop tokens back in its mask, unless they are all its
grammar allows (the grammar wins); the sampler's own min_tokens mask skips constrained rows.
A step without a constrained row gets `NO_MASKS`: no bitmask, no thread, nothing to apply.

Why some rows are checked rather than masked: vLLM fills every constrained row's mask while the
forward runs and masks before sampling; so does aserve on an accelerator, and on the CPU for
every row but plain greedy ones. On the CPU the fill competes with the forward for the same
cores (a mask costs llguidance far more a row than checking one token does;
docs/benchmarks/structured-outputs.md), and a greedy row's token is the largest logit whether
masked or not, when the grammar allows it: such a row is sampled unmasked and its token
checked, and only a refused one gets a mask and the argmax of its allowed tokens. A model that
follows its format is refused rarely.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not

import torch

from aserve.runner.request_state import CachedRequestState
from aserve.sampling_params import SamplingParams, SamplingType
from aserve.structured_output import (
    GrammarMatcher,
    apply_token_bitmask,
    fill_token_bitmask,
    masked_argmax,
)


def is_checked_after(params: SamplingParams) -> bool:
    """Whether a constrained row may be sampled unmasked and its token checked after: plain
    greedy, whose token is the largest logit, which stays the largest of the allowed ones when
    allowed (no logit processor, no logprobs)."""
    return (params.sampling_type == SamplingType.GREEDY and params.logprobs is None
            and not params.logit_bias and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)


@dataclass(frozen=True)
class TokenMasks:
    """A step's constrained rows (indices among its sampling rows): `ahead`, masked before
    sampling by `bitmask` (int32 [len(ahead), ceil(vocab / 32)], filled beside the forward);
    `checked`, sampled unmasked and their tokens checked after."""

    ahead: list[int]
    bitmask: Future[torch.Tensor] | None
    checked: list[int]


NO_MASKS = TokenMasks([], None, [])
GRAMMAR_OF = attrgetter("grammar")


class GrammarMasks:
    """`check_greedy_tokens`: check plain greedy rows after sampling instead of masking them
    first (the CPU's choice, `Platform.computes_on_host`; see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, check_greedy_tokens: bool) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.check_greedy_tokens = check_greedy_tokens
        self._filler: ThreadPoolExecutor | None = None  # started by the first row masked ahead

    def start(self, states: list[CachedRequestState],
              drafts: list[list[int]] | None = None) -> TokenMasks:
        """The constrained rows among a step's sampling rows `states`, and the bitmask of those
        masked ahead, started on a thread of its own that runs beside the forward (llguidance
        releases the GIL; the fill depends only on tokens already accepted, not on logits).
        `drafts[k]`: the speculative drafts row k comes after (its mask is the grammar's after
        them; such a row is always masked ahead)."""
        constrained = list(compress(range(len(states)),  # (C-level: no bytecode a row)
                                    map(is_not, map(GRAMMAR_OF, states), repeat(None))))
        if not constrained:
            return NO_MASKS
        after = [drafts[k] if drafts else [] for k in range(len(states))]
        checked = [k for k in constrained if self.check_greedy_tokens and not after[k]
                   and is_checked_after(states[k].sampling_params)]
        ahead = sorted(set(constrained) - set(checked))
        bitmask = None
        if ahead:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="aserve-grammar")
            bitmask = self._filler.submit(self._fill, [states[k] for k in ahead],
                                          [after[k] for k in ahead])
        return TokenMasks(ahead, bitmask, checked)

    def draft_bitmask(self, states: list[CachedRequestState],
                      spec_drafts: list[tuple[int, list[int]]]) -> tuple[list[int], torch.Tensor]:
        """The masks of the draft rows of constrained speculating requests (row j of request
        i: its grammar after drafts[:j]), as (their indices among all draft rows, bitmask).
        Past a draft the grammar refuses, rows are left open: verification rejects that
        draft (its probability is 0 under the mask), so they are never reached."""
        rows, matchers, held, row = [], [], [], 0
        for i, drafts in spec_drafts:
            state = states[i]
            if state.grammar is not None:
                stops = ([t for t in state.stop_token_ids if 0 <= t < self.vocab_size]
                         if state.is_below_min_tokens else [])
                fork = state.grammar.fork()
                for j, token_id in enumerate(drafts):
                    rows.append(row + j)
                    matchers.append(fork.fork())
                    held.append(stops)
                    if j + 1 < len(drafts) and not _advance(fork, token_id):
                        break
            row += len(drafts)
        if not rows:
            return [], torch.empty(0)
        return rows, fill_token_bitmask(matchers, self.vocab_size, held)

    def apply(self, logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
        """`logits` [num_sampling_rows, vocab] with the ahead rows' disallowed tokens at -inf
        (one masked copy for them all; waits for the fill), or `logits` itself."""
        if not masks.ahead:
            return logits
        bitmask = masks.bitmask.result()
        if len(masks.ahead) == len(logits):  # every row: no index to scatter by
            return apply_token_bitmask(logits, bitmask)
        index = torch.tensor(masks.ahead, dtype=torch.int64).to(self.device)
        return apply_token_bitmask(logits, bitmask, index)

    def check(self, states: list[CachedRequestState], logits: torch.Tensor,
              token_ids: list[int], masks: TokenMasks) -> None:
        """Checked rows: where the grammar refuses the sampled token (or it is a stop token
        before min_tokens), the argmax of the allowed tokens instead, in `token_ids`."""
        refused = [k for k in masks.checked if not _accepts(states[k], token_ids[k])]
        if not refused:
            return
        bitmask = self._fill([states[k] for k in refused])
        index = torch.tensor(refused, dtype=torch.int64)
        for k, token_id in zip(refused, masked_argmax(logits, index, bitmask).tolist()):
            token_ids[k] = token_id

    def _fill(self, states: list[CachedRequestState],
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The bitmask of these constrained rows (each after its `drafts`, if any); a row short
        of its min_tokens holds back its stop tokens in it."""
        held = [[t for t in s.stop_token_ids if 0 <= t < self.vocab_size]
                if s.is_below_min_tokens else [] for s in states]
        matchers = [s.grammar for s in states]
        for k, after in enumerate(drafts or []):
            if after:
                fork = matchers[k].fork()
                for token_id in after:  # (one refused: the row's token is never kept)
                    if not _advance(fork, token_id):
                        break
                matchers[k] = fork
        return fill_token_bitmask(matchers, self.vocab_size, held)


def _advance(matcher: GrammarMatcher, token_id: int) -> bool:
    """Advance a fork by a draft the grammar allows; False (unmoved) for one it refuses."""
    return matcher.allows(token_id) and matcher.accept_token(token_id)


def _accepts(state: CachedRequestState, token_id: int) -> bool:
    if state.is_below_min_tokens and token_id in state.stop_token_ids:
        return False  # (the mask decides: held back, unless the grammar has ended)
    return state.grammar.allows(token_id)
