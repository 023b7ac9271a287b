"""`StepPlan`: one step's schedule while `Scheduler.schedule()` builds it.

    budgets   num_tokens          what is left of max_num_batched_tokens
              num_prefill_tokens  what is left of the step's prefill cap (`PrefillPolicy`),
                                  in tokens of the step-cost fit: a chunk after C tokens
                                  spends its tokens and `key_cost_tokens` per key it attends
                                  (`step_cost.chunk_cost`), so a chunk over a long cached
                                  prefix gets fewer tokens than one at the start of a prompt;
                                  worked out when first needed (`resolve_prefill_cap`): a step
                                  of decodes alone never asks
    num_decodes   the requests given a decode (not a prefill chunk) so far
    num_keys      the keys the rows given so far attend (`step_cost.attention_keys`)
    spent(num_decodes, num_keys)      plain decodes the scheduler's loop entered itself
                                      (one token past the prompt, no block needed): their
                                      budgets, counted there
    schedule(request, n, block_ids)   a running request gets n tokens and its new blocks
    admit(request, n)                 a waiting (or loaded) request is admitted with n tokens
    unschedule(victim)                a preempted request: its tokens go back to the budgets

A prefill chunk (`is_prefill`) spends both budgets, a decode only the first. The plan lives for
one `schedule()` call, which then turns it into a `SchedulerOutput`: the running requests'
`CachedRequestData` are made as they are scheduled; `decodes` (one token each) and `others`
are the requests whose counters the step moves on. It reads a request's `num_computed_tokens`
as it was before the step (the scheduler advances them afterwards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aserve.core.outputs import CachedRequestData
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
    def __init__(self, num_tokens: int,
                 prefill_cap: Callable[[], tuple[float, float]] | None = None) -> None:
        """`prefill_cap()`: the step's prefill budget and `key_cost_tokens` (asked once, at
        the first prefill, or where `resolve_prefill_cap` is called); None: the whole token
        budget, each token at its count."""
        self.num_tokens = num_tokens
        self._budget = num_tokens
        self._prefill_cap = prefill_cap
        self.num_prefill_tokens: float | None = None  # (`resolve_prefill_cap`)
        self.key_cost_tokens = 0.0
        # In batch order: running requests first, then admitted ones.
        self.num_scheduled: dict[str, int] = {}
        self.cached: dict[str, CachedRequestData] = {}  # the running requests'
        self.decodes: list[Request] = []  # running requests the scheduler's loop gave a
        # plain decode (one token, no block: `spent`)
        self.others: list[Request] = []  # every other request scheduled, admitted ones too
        self.admitted: list[Request] = []
        self.preempted: list[Request] = []
        self.num_decodes = 0
        self.num_keys = 0

    def resolve_prefill_cap(self) -> None:
        """Fix the prefill budget (once). The first prefill asks for it; the scheduler asks
        before anything changes what it is worked out from (the running and waiting requests)."""
        if self.num_prefill_tokens is None:
            if self._prefill_cap is None:
                self.num_prefill_tokens = self._budget
            else:
                self.num_prefill_tokens, self.key_cost_tokens = self._prefill_cap()

    def limit(self, prefill: bool, num_computed: int) -> int:
        """The most tokens one more request, `num_computed` tokens in, may get: a prefill
        chunk within both budgets (at least one token while the prefill budget lasts)."""
        if not prefill:
            return self.num_tokens
        self.resolve_prefill_cap()
        within = tokens_within(self.num_prefill_tokens, num_computed, self.key_cost_tokens)
        if not within and self.num_prefill_tokens > 0:
            within = 1
        return min(self.num_tokens, within)

    def spent(self, num_decodes: int, num_keys: int) -> None:
        """`num_decodes` plain decodes, attending `num_keys` keys in all: running requests
        given one token past their prompt that needs no block, which the scheduler's loop
        entered itself (in `num_scheduled`, `cached` and `decodes`)."""
        self.num_tokens -= num_decodes
        self.num_decodes += num_decodes
        self.num_keys += num_keys

    def schedule(self, request: Request, num_tokens: int, block_ids: tuple[Sequence[int], ...]
                 ) -> None:
        req_id = request.request_id
        num_computed = request.num_computed_tokens
        self.num_scheduled[req_id] = num_tokens
        self.cached[req_id] = CachedRequestData(req_id, block_ids, num_computed)
        self.others.append(request)
        self._spend(request, num_tokens)

    def admit(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.admitted.append(request)
        self.others.append(request)
        self._spend(request, num_tokens)

    def unschedule(self, request: Request) -> None:
        """`request` is preempted: whatever it was given this step goes back to the budgets."""
        num_given = self.num_scheduled.pop(request.request_id, 0)
        if num_given:
            self._spend(request, -num_given)
            self.cached.pop(request.request_id, None)
            for scheduled in (self.decodes, self.others):
                if request in scheduled:
                    scheduled.remove(request)
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
            self.resolve_prefill_cap()
            self.num_prefill_tokens -= sign * (count + self.key_cost_tokens * keys)
        else:
            self.num_decodes += sign
