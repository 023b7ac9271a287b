"""Speculative decoding's seam in the scheduler (docs/design.md §8, "Speculative decoding"):
which requests draft, how many drafts pay, the draft model's lookahead slots, the tokens a
verified step gives, and the counters behind the `spec_decode_*` metrics. The `Scheduler`
calls one of these at fixed points of a step and knows nothing else of speculation:

    schedule()            would_draft (async: wait for the token in flight), lookahead
                          (`_allocate`), schedule_request (drafts ride along; the draft
                          model's count), draft_model_runs
    update_from_output()  observe (the runner's drafts and pass time), verified_tokens,
                          propose (within PROPOSE_SECONDS), finish (via `_free`)

`NoSpeculation` answers them without speculating (no drafts, no lookahead, one token a step),
so the scheduler has no branch of its own on whether a model speculates, beyond `speculates`:
without it a plain decode takes the scheduler's own loop (none of the calls above). The
proposers and the cost rule (`worthwhile_drafts`) are `speculation.py`'s.
"""

from __future__ import annotations

import time

from aserve.config import SpeculativeConfig
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.core.request import Request
from aserve.core.speculation import (
    ACCEPTANCE_RELAX,
    can_speculate,
    make_proposer,
    max_drafts_before_min_tokens,
    worthwhile_drafts,
)
from aserve.core.step_cost import StepCostModel

PROPOSE_SECONDS = 0.005  # a step's budget for proposing drafts
PRIOR_DRAFT_TOKENS = 64  # verified drafts before their rate is a new request's prior


class NoSpeculation:
    """A model that does not speculate: a token a step, no slots past it."""

    num_lookahead = 0
    speculates = False

    def would_draft(self, request: Request, num_running: int) -> bool:
        return False

    def lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        return 0

    def schedule_request(self, output: SchedulerOutput, request: Request, num_tokens: int,
                         num_running: int) -> None:
        pass

    def draft_model_runs(self, running: list[Request]) -> bool:
        return False

    def observe(self, runner_output: ModelRunnerOutput) -> None:
        pass

    def verified_tokens(self, request: Request, drafts: list[int] | None, num_accepted: int,
                        token_id: int) -> list[int]:
        return [token_id]

    def propose(self, request: Request, num_running: int) -> None:
        pass

    def finish(self, request: Request) -> None:
        pass

    def stats(self) -> dict:
        return {}


class SpecPolicy(NoSpeculation):
    """Drafts for the requests whose drafts pay (`worthwhile_drafts`, from `step_cost`'s fit,
    each request's acceptance so far and a draft model's pass time), within `max_model_len`."""

    speculates = True

    def __init__(self, config: SpeculativeConfig, step_cost: StepCostModel,
                 max_model_len: int) -> None:
        self.proposer = make_proposer(config)
        self.step_cost, self.max_model_len = step_cost, max_model_len
        # a draft model's passes write k positions past a step's tokens: slots for them
        self.num_lookahead = config.num_speculative_tokens if config.runner_drafts else 0
        self.draft_pass_seconds = 0.0  # a draft model's pass, averaged over steps
        self.num_drafts = self.num_draft_tokens = 0  # steps that verified drafts; their drafts
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self._propose_until = 0.0

    # ------------------------------------------------------------------ schedule

    def would_draft(self, request: Request, num_running: int) -> bool:
        """Whether drafts would pay for the request's next step (under async scheduling it
        then waits for its token in flight, which its drafts follow)."""
        return (can_speculate(request.sampling_params)
                and self.drafts_for(request, num_running) > 0)

    def lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        """Slots to reserve past a step's tokens, where the step reaches the request's last
        known token (it samples; a draft model then drafts into them), within max_model_len.
        (Never short of it: the slots would cover known tokens not computed yet, and their
        full blocks would be registered in the prefix cache before their K/V is written.)"""
        if (not self.num_lookahead or num_computed + num_new < request.num_tokens
                or request.num_output_placeholders):  # (overlapped: it does not draft)
            return 0
        return max(0, min(self.num_lookahead, self.max_model_len - num_computed - num_new))

    def schedule_request(self, output: SchedulerOutput, request: Request, num_tokens: int,
                         num_running: int) -> None:
        """A scheduled request's part of the output (before its `num_computed_tokens` moves
        on): the drafts it carries (trimmed to what the step gives), and, where the step
        reaches its last token, how many the draft model is to draft after it."""
        req_id = request.request_id
        if (self.num_lookahead and request.num_computed_tokens + num_tokens
                >= request.num_tokens and not request.num_output_placeholders
                and can_speculate(request.sampling_params)
                and (n := self.drafts_for(request, num_running)) > 0):
            output.num_draft_tokens[req_id] = n
        if request.spec_token_ids:
            output.scheduled_spec_decode_tokens[req_id] = list(request.spec_token_ids)

    def draft_model_runs(self, running: list[Request]) -> bool:
        """Whether a draft model (or EAGLE head) runs this step: while `drafting_pays`. It
        keeps its K/V while it does, and rests while it does not."""
        return bool(self.num_lookahead) and self.drafting_pays(running)

    def drafting_pays(self, running: list[Request]) -> bool:
        """Whether a first draft pays at this batch size for the running request likeliest
        to have it accepted (its acceptance estimate; 1 before its first verification). Not
        while the batch is compute-bound beside the draft model's passes, or drafts are rarely
        accepted; the estimates drift back toward 1 while nothing is verified
        (`ACCEPTANCE_RELAX`), so a draft model runs again to measure them."""
        prior = self.prior_acceptance()
        best = max((prior if r.spec_acceptance is None else r.spec_acceptance
                    for r in running), default=prior)
        return worthwhile_drafts(1, best, self.step_cost.fixed_cost_tokens(), len(running),
                                 self._pass_tokens()) > 0

    def drafts_for(self, request: Request, num_running: int) -> int:
        """Drafts worth proposing for the request's next step: as many as pay for themselves
        in a step of this many decodes, and as its max_tokens, the model's length and its
        min_tokens leave room for after the token the step samples anyway."""
        acceptance = (self.prior_acceptance() if request.spec_acceptance is None
                      else request.spec_acceptance)
        room = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens,
                   worthwhile_drafts(self.proposer.k, acceptance,
                                     self.step_cost.fixed_cost_tokens(), num_running,
                                     self._pass_tokens()) + 1) - 1
        below_min = max_drafts_before_min_tokens(request.num_output_tokens,
                                                 request.sampling_params.min_tokens)
        return room if below_min is None else min(room, below_min)

    def prior_acceptance(self) -> float:
        """What a request none of whose drafts were verified yet is taken to accept: every
        request's rate so far, once `PRIOR_DRAFT_TOKENS` drafts were verified (a drafter
        whose drafts are rarely accepted then keeps new requests from waiting to draft), else
        all of them."""
        if self.num_draft_tokens < PRIOR_DRAFT_TOKENS:
            return 1.0
        return sum(self.accepted_per_pos) / self.num_draft_tokens

    def _pass_tokens(self) -> float:
        """A draft model's pass, in tokens of the step-cost fit (its seconds / b)."""
        fit = self.step_cost.fit()
        return self.draft_pass_seconds / fit[1] if fit is not None and fit[1] > 0 else 0.0

    # ------------------------------------------------------------------ update

    def observe(self, runner_output: ModelRunnerOutput) -> None:
        """A step's output arrived: the runner's drafts, a draft model's pass time; lookups
        get PROPOSE_SECONDS of the engine thread from now, whatever requests' texts make
        them cost (requests past it decode a token their next step, unchanged)."""
        self._propose_until = time.perf_counter() + PROPOSE_SECONDS
        self.proposer.observe(runner_output.draft_token_ids)
        if runner_output.draft_passes:
            seconds = runner_output.draft_seconds / runner_output.draft_passes
            self.draft_pass_seconds = (seconds if not self.draft_pass_seconds
                                       else 0.8 * self.draft_pass_seconds + 0.2 * seconds)

    def verified_tokens(self, request: Request, drafts: list[int] | None, num_accepted: int,
                        token_id: int) -> list[int]:
        """The tokens a step gave `request`: its accepted drafts, then the token sampled
        after them. The rejected drafts' positions are rolled back (their K/V slots are
        written again by the steps that compute the real tokens there)."""
        if not drafts:
            if request.spec_acceptance is not None:  # unmeasured this step: toward the prior
                request.spec_acceptance += ACCEPTANCE_RELAX * (1.0 - request.spec_acceptance)
            return [token_id]
        request.spec_token_ids = []
        request.num_computed_tokens -= len(drafts) - num_accepted
        rate = num_accepted / len(drafts)
        request.spec_acceptance = (rate if request.spec_acceptance is None
                                   else 0.7 * request.spec_acceptance + 0.3 * rate)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1
        return [*drafts[:num_accepted], token_id]

    def propose(self, request: Request, num_running: int) -> None:
        """Drafts for a decoding request's next step, as many as `drafts_for` says, while
        this step's lookup time lasts."""
        if (request.is_finished or time.perf_counter() >= self._propose_until
                or request.num_computed_tokens + 1 != request.num_tokens
                or not can_speculate(request.sampling_params)):
            return
        room = self.drafts_for(request, num_running)
        if room > 0:
            request.spec_token_ids = self.proposer.propose(request.request_id,
                                                           request.all_token_ids, room)

    def finish(self, request: Request) -> None:
        self.proposer.finish(request.request_id, request.output_token_ids)

    def stats(self) -> dict:
        """`SchedulerStats`' speculative fields."""
        return dict(spec_decode_num_drafts=self.num_drafts,
                    spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=sum(self.accepted_per_pos),
                    spec_decode_num_accepted_tokens_per_pos=tuple(self.accepted_per_pos))


def make_spec_policy(config: SpeculativeConfig | None, step_cost: StepCostModel,
                     max_model_len: int) -> NoSpeculation:
    return (NoSpeculation() if config is None
            else SpecPolicy(config, step_cost, max_model_len))
