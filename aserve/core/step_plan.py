"""`StepPlan`: one step's schedule while `Scheduler.schedule()` builds it.

    budgets   num_tokens          what is left of max_num_batched_tokens
              num_prefill_tokens  what is left of the step's prefill cap (`PrefillPolicy`),
                                  in tokens of the step-cost fit: a chunk after C tokens
                                  spends its tokens and `key_cost_tokens` per key it attends
                                  (`step_cost.chunk_cost`), so a chunk over a long cached
                                  prefix gets fewer tokens than one at the start of a prompt
    num_decodes   the requests given a decode (not a prefill chunk) so far
    num_keys      the keys the rows given so far attend (`step_cost.attention_keys`)
    schedule(request, n, block_ids)   a running request gets n tokens and its new blocks
    admit(request, n)                 a waiting (or loaded) request is admitted with n tokens
    unschedule(victim)                a preempted request: its tokens go back to the budgets

A prefill chunk (`is_prefill`) spends both budgets, a decode only the first. The plan lives for
one `schedule()` call, which then turns it into a `SchedulerOutput`; it reads a request's
`num_computed_tokens` as it was before the step (the scheduler advances them afterwards).
"""

from __future__ import annotations

from collections.abc import Sequence

from aserve.core.request import Request
from aserve.core.step_cost import attention_keys, tokens_within


def is_prefill(request: Request, num_computed: int, num_new: int) -> bool:
    """Whether `num_new` tokens from `num_computed` on are a prefill chunk (prompt, or the
    recomputation of a preempted request), not a decode's one token past the prompt (with its
    drafts, under speculative decoding)."""
    if num_computed < len(request.prompt_token_ids):
        return True
    if num_new == 1:  # (most calls: one token past the prompt)
        return False
    drafts = len(request.spec_token_ids) if num_computed + 1 == len(request.all_token_ids) else 0
    return num_new > 1 + drafts


class StepPlan:
    def __init__(self, num_tokens: int, num_prefill_tokens: float,
                 key_cost_tokens: float = 0.0) -> None:
        self.num_tokens = num_tokens
        self.num_prefill_tokens = num_prefill_tokens
        self.key_cost_tokens = key_cost_tokens
        # In batch order: running requests first, then admitted ones.
        self.num_scheduled: dict[str, int] = {}
        self.new_block_ids: dict[str, tuple[Sequence[int], ...]] = {}  # running requests' only
        self.admitted: list[Request] = []
        self.preempted: list[Request] = []
        self.num_decodes = 0
        self.num_keys = 0

    def limit(self, prefill: bool, num_computed: int) -> int:
        """The most tokens one more request, `num_computed` tokens in, may get: a prefill
        chunk within both budgets (at least one token while the prefill budget lasts)."""
        if not prefill:
            return self.num_tokens
        within = tokens_within(self.num_prefill_tokens, num_computed, self.key_cost_tokens)
        if not within and self.num_prefill_tokens > 0:
            within = 1
        return min(self.num_tokens, within)

    def schedule(self, request: Request, num_tokens: int, block_ids: tuple[Sequence[int], ...]
                 ) -> None:
        req_id = request.request_id
        self.num_scheduled[req_id] = num_tokens
        self.new_block_ids[req_id] = block_ids
        num_computed = request.num_computed_tokens
        if num_tokens == 1 and num_computed >= len(request.prompt_token_ids):
            self.num_tokens -= 1  # (most calls: a decode; `_spend`'s sums for one token)
            self.num_keys += num_computed + 1
            self.num_decodes += 1
        else:
            self._spend(request, num_tokens)

    def admit(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.admitted.append(request)
        self._spend(request, num_tokens)

    def unschedule(self, request: Request) -> None:
        """`request` is preempted: whatever it was given this step goes back to the budgets."""
        num_given = self.num_scheduled.pop(request.request_id, 0)
        if num_given:
            self._spend(request, -num_given)
        self.new_block_ids.pop(request.request_id, None)
        self.preempted.append(request)

    def _spend(self, request: Request, num_tokens: int) -> None:
        """Take `num_tokens` (given back where negative) from the budgets."""
        num_computed, count, sign = request.num_computed_tokens, abs(num_tokens), 1
        if num_tokens < 0:
            sign = -1
        keys = attention_keys(num_computed, count)
        self.num_tokens -= num_tokens
        self.num_keys += sign * keys
        if is_prefill(request, num_computed, count):
            self.num_prefill_tokens -= sign * (count + self.key_cost_tokens * keys)
        else:
            self.num_decodes += sign
