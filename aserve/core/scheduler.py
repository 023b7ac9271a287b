"""The scheduler: one token budget per step, spent on running requests first, then waiting ones.

There are no prefill and decode phases. A request has `num_computed_tokens`; a step gives it
`num_scheduled_tokens` more (a whole prompt, a chunk of one, or the one token sampled last step).
That covers chunked prefill, prefix-cache hits and resumption after preemption alike.

    schedule():  running ──(budget, blocks; preempt the last one while blocks run out)──┐
                 loaded  ──(if nothing was preempted: K/V a connector loaded)───────────┤
                 waiting ──(if nothing was preempted: prefix hit, blocks, max_num_seqs)─┤
                                                        StepPlan ─► SchedulerOutput ◄───┘
    update_from_output(): append sampled tokens, check stops, free finished requests' blocks;
                          finish the pooling requests whose prompt the runner pooled; the
                          step's outputs (`StepOutputs`: a plain token goes in its columns).

`running` is in preemption order, the victim last: admission order (FCFS), or sorted by
`Request.sort_key` as requests join it, ties in admission order (priority), so that a victim is
never one already scheduled this step. A step's spending is a `StepPlan` (`step_plan.py`):
preempting is `plan.unschedule(victim)`. Prefill beside decodes is capped by `config.prefill`
(`PrefillPolicy`) with the step cost fitted to the steps that ran (`step_cost.py`). Blocks are
per KV cache group: the `KVCacheManager` answers for every group at once. A KV connector
(injected by the engine) is reached through `remote_kv` (`remote_kv.py`: `RemoteKV`, or
`NoRemoteKV` when there is none), speculative decoding through `spec` (`spec_policy.py`:
`SpecPolicy`, or `NoSpeculation`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence

from aserve.config import CacheConfig, SchedulerConfig
from aserve.core.kv_cache_coordinator import GroupBlocks
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.kv_connector import KVConnectorScheduler
from aserve.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    StepOutputs,
)
from aserve.core.remote_kv import make_remote_kv
from aserve.core.request import FINISH_REASONS, Request, RequestStatus
from aserve.core.request_queue import create_request_queue
from aserve.core.scheduler_checks import check_scheduler
from aserve.core.spec_policy import make_spec_policy
from aserve.core.step_cost import StepCostModel, chunk_cost, prefill_token_cap
from aserve.core.step_plan import StepPlan, is_prefill

# `CachedRequestData(*fields)` without the Python-level `__new__` a NamedTuple has
new_cached_data = functools.partial(tuple.__new__, CachedRequestData)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_connector: KVConnectorScheduler | None = None) -> None:
        if cache_config.num_blocks < 1:
            raise ValueError("CacheConfig.num_blocks must be set before building the scheduler.")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            cache_config.kv_cache_groups)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # in preemption order: the victim is the last
        # Requests the runner still holds but must drop: finished or aborted since last step.
        self.finished_req_ids: set[str] = set()
        # Per request asking for prompt logprobs: prompt positions whose rows went out already.
        self.num_prompt_logprobs_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.step_cost = StepCostModel()
        self.remote_kv = make_remote_kv(kv_connector, self.kv_cache_manager)
        self._last_output: SchedulerOutput | None = None
        self.spec = make_spec_policy(scheduler_config.speculative, self.step_cost,
                                     scheduler_config.max_model_len)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish (by default: abort) unfinished requests; unknown ids are ignored."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not self.remote_kv.remove(request):
                self.waiting.remove(request)
            request.status = status
            self._free(request, loading)
            finished.append(request)
        return finished

    def _free(self, request: Request, loading: bool = False) -> dict | None:
        """Forget a finished request; free its blocks unless the workers still use them
        (`loading` into them, or the connector sends them). Returns the connector's
        `kv_transfer_params` for the client."""
        held, params = self.remote_kv.request_finished(request, loading)
        if not held:
            self.kv_cache_manager.free(request)
        self.spec.finish(request)
        self.finished_req_ids.add(request.request_id)
        self.num_prompt_logprobs_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        return params

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + self.remote_kv.num_requests

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def has_kv_transfers(self) -> bool:
        """Finished requests whose blocks the workers still send or load into."""
        return self.remote_kv.has_held_blocks()

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.config.max_num_batched_tokens, self._prefill_cap)
        self._schedule_running(plan)
        if not plan.preempted:
            if self.waiting or self.remote_kv.num_requests:
                plan.resolve_prefill_cap()  # (of the requests before any is admitted)
            self._schedule_loaded(plan)
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        output.num_decode_tokens, output.num_attention_keys = plan.num_decodes, plan.num_keys
        output.draft_model_runs = self.spec.draft_model_runs(self.running)
        overlapped = self.config.async_scheduling
        for request in plan.decodes:  # (a token each, its token in flight where overlapped)
            request.num_computed_tokens += 1
            request.num_output_placeholders += overlapped
        num_running, num_scheduled = len(self.running), plan.num_scheduled
        schedule_request = self.spec.schedule_request
        for request in plan.others:
            num_tokens = num_scheduled[request.request_id]
            schedule_request(output, request, num_tokens, num_running)
            request.num_computed_tokens += num_tokens
            if overlapped and request.num_computed_tokens == (
                    len(request.all_token_ids) + request.num_output_placeholders):
                request.num_output_placeholders += 1  # it samples: a token is on its way
        output.kv_connector_metadata = self.remote_kv.build_connector_meta(output)
        self._last_output = output
        return output

    def _prefill_cap(self) -> tuple[float, float]:
        """The step's prefill budget (`_max_prefill_tokens`) and the `key_cost_tokens` it is
        counted in; without a cap the whole budget, tokens at their count (`StepPlan` asks
        at the step's first prefill)."""
        cap = self._max_prefill_tokens()
        if cap is None:
            return self.config.max_num_batched_tokens, 0.0
        return cap, self.step_cost.key_cost_tokens()

    def _max_prefill_tokens(self) -> float | None:
        """Prefill this step may carry (`step_cost.prefill_token_cap`), in tokens of the
        step-cost fit (`StepPlan` prices each chunk by its context); None: no cap. Worked
        out from the running and waiting requests as they were when the step began."""
        num_decoding = decode_keys = 0
        for request in self.running:
            if (num_computed := request.num_computed_tokens) >= len(request.prompt_token_ids):
                num_decoding += 1
                decode_keys += num_computed + 1
        decode_cost = num_decoding + self.step_cost.key_cost_tokens() * decode_keys
        return prefill_token_cap(self.config, self.step_cost, num_decoding,
                                 self._pending_within, self.block_size, decode_cost)

    def _pending_within(self, limit: float) -> float:
        """Prompts not prefilled yet, in tokens of the step-cost fit (`chunk_cost`), counted
        up to `limit`: the whole prompts of running prefills and waiting requests past their
        cached prefix (the whole prompt, not its rest: drained at pending / steps a step, a
        prompt then ends within those steps)."""
        k, pending = self.step_cost.key_cost_tokens(), 0.0
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                cached = max(0, request.num_cached_tokens)
                pending += chunk_cost(request.num_prompt_tokens - cached, cached, k)
        for request in self.waiting:
            if pending >= limit:
                break
            cached = self.kv_cache_manager.get_computed_blocks(request)[1]
            pending += chunk_cost(request.num_tokens - cached, cached, k)
        return min(pending, limit)

    def _num_tokens_to_schedule(self, request: Request, num_computed: int,
                                plan: StepPlan) -> int:
        """Tokens to give `request` this step: 0 when it must wait for tokens in flight (or
        for the prefill budget of a later step)."""
        num_pending = request.num_output_placeholders
        if num_pending and (request.num_output_tokens + num_pending >= request.max_tokens
                            or request.num_tokens + num_pending >= self.config.max_model_len
                            or self.config.max_batches_in_flight > 1
                            or self.spec.would_draft(request, len(self.running))):
            return 0  # its token in flight is its last one, or the next batch (or its
            # drafts, which follow that token) needs it
        num_new = len(request.all_token_ids) + num_pending - num_computed
        if num_new == 1:  # decoding: its drafts ride along (none without speculation)
            if not request.spec_token_ids and num_computed >= len(request.prompt_token_ids):
                return min(1, plan.num_tokens)  # (most calls: one decode token, not prefill)
            num_new += len(request.spec_token_ids)
        threshold = self.config.prefill.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, plan.limit(is_prefill(request, num_computed, num_new), num_computed))

    def _schedule_running(self, plan: StepPlan) -> None:
        running, to_schedule, allocate = self.running, self._num_tokens_to_schedule, self._allocate
        kv = self.kv_cache_manager
        no_new_blocks = kv.no_new_blocks
        # A plain decode — one token past the prompt, inside the blocks it holds
        # (`num_covered_tokens`), its token in flight (if any) not its last — is the whole of
        # most requests of most steps: this loop enters it in the plan itself (its budgets
        # counted here, handed over with `plan.spent`), in place of the calls below. Not
        # under speculation (drafts, lookahead slots), nor with batches queued behind the
        # one in flight.
        plain = not self.spec.speculates and self.config.max_batches_in_flight == 1
        max_model_len = self.config.max_model_len
        num_scheduled, cached, decodes = plan.num_scheduled, plan.cached, plan.decodes
        num_tokens, num_decodes, num_keys = plan.num_tokens, 0, 0
        index = 0
        while index < len(running) and num_tokens > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            if plain and num_computed < request.num_covered_tokens and num_computed >= len(
                    request.prompt_token_ids):
                pending = request.num_output_placeholders
                if num_computed + 1 == len(request.all_token_ids) + pending and (
                        not pending or (num_computed + 1 < max_model_len and len(
                            request.output_token_ids) + pending < request.max_tokens)):
                    req_id = request.request_id
                    num_scheduled[req_id] = 1
                    cached[req_id] = new_cached_data((req_id, no_new_blocks, num_computed))
                    decodes.append(request)
                    num_tokens -= 1
                    num_decodes += 1
                    num_keys += num_computed + 1
                    index += 1
                    continue
            plan.spent(num_decodes, num_keys)  # (the general case reads the plan's budgets)
            num_decodes = num_keys = 0
            num_new = to_schedule(request, num_computed, plan)
            if request.spec_token_ids and num_new > 0:  # the drafts the budget leaves room for
                del request.spec_token_ids[num_new - 1:]
            if num_new <= 0:
                index += 1
            else:
                while (block_ids := allocate(request, num_new)) is None:
                    plan.resolve_prefill_cap()  # (before `running` changes)
                    victim = running.pop()
                    self._preempt(victim, plan)
                    if victim is request:
                        break  # `index` is now past the end
                else:
                    plan.schedule(request, num_new, block_ids)
                    index += 1
            num_tokens = plan.num_tokens
        plan.spent(num_decodes, num_keys)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free a request taken off `running`; it waits again, to be recomputed."""
        plan.unschedule(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is dropped and sampled again
        request.num_external_computed_tokens = 0  # loaded K/V gone too: recomputed
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _can_admit(self, plan: StepPlan) -> bool:
        return plan.num_tokens > 0 and len(self.running) < self.config.max_num_seqs

    def _schedule_loaded(self, plan: StepPlan) -> None:
        """Requests whose K/V a connector loaded go first: they hold their blocks already.
        One that cannot grow while nothing runs (nothing would free a block) is unloaded and
        waits as any request."""
        while (request := self.remote_kv.next_loaded()) is not None and self._can_admit(plan):
            num_computed = request.num_computed_tokens
            num_new = self._num_tokens_to_schedule(request, num_computed, plan)
            if num_new <= 0:
                return
            if self.kv_cache_manager.allocate_slots(request, num_new) is None:
                if self.running:
                    return
                self.remote_kv.unload(request)
                self.waiting.prepend(request)
                continue
            self.remote_kv.remove(request)
            self._admit(request, num_computed, num_new, plan)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in policy order, each with its longest cached prefix, until
        one does not fit; one whose K/V a connector can load starts loading instead."""
        kv = self.kv_cache_manager
        while self.waiting and self._can_admit(plan):
            request = self.waiting.peek()
            cached_blocks, num_cached = kv.get_computed_blocks(request)
            num_external = self.remote_kv.num_loadable_tokens(request, num_cached)
            if num_external:
                if not self._start_load(request, num_cached, cached_blocks, num_external):
                    break
                continue
            num_new = self._num_tokens_to_schedule(request, num_cached, plan)
            if num_new <= 0 or self._allocate(request, num_new, num_cached,
                                              cached_blocks) is None:
                break
            self.remote_kv.register_local(request)
            self.waiting.pop()
            self._admit(request, num_cached, num_new, plan)

    def _start_load(self, request: Request, num_cached: int, cached_blocks: GroupBlocks,
                    num_external: int) -> bool:
        """Start loading the waiting request at the head; False (nothing changed) when blocks
        are short. When nothing could ever free blocks, the load is given up and the request
        stays at the head, to be computed here."""
        if self.remote_kv.start_load(request, num_cached, cached_blocks, num_external):
            self.waiting.pop()
            return True
        if self.running or self.remote_kv.has_blocks_in_use():
            return False
        self.remote_kv.give_up_load(request)
        return True

    def _admit(self, request: Request, num_computed: int, num_new: int, plan: StepPlan) -> None:
        plan.resolve_prefill_cap()  # (before `running` changes)
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.status = RequestStatus.RUNNING
        if self.config.policy == "priority":  # after the requests of its key: in admission order
            bisect.insort(self.running, request, key=Request.sort_key)
        else:
            self.running.append(request)
        plan.admit(request, num_new)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new = [
            NewRequestData(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                           r.sampling_params, kv.get_block_ids(r.request_id),
                           r.num_computed_tokens, r.stop_token_ids, r.grammar,
                           r.pooling_params)
            for r in plan.admitted
        ]
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=list(plan.cached.values()),
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in plan.preempted},
        )

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> StepOutputs:
        step = StepOutputs()
        outputs = step.outputs
        spec = self.spec
        spec.observe(runner_output)
        for request in self.remote_kv.update_from_output(runner_output.kv_connector_output):
            self.waiting.prepend(request)  # a failed load: computed here, from scratch
        if scheduler_output.total_num_scheduled_tokens:
            self.step_cost.record(scheduler_output.total_num_scheduled_tokens,
                                  runner_output.forward_seconds,
                                  scheduler_output.num_attention_keys)
        for req_id, vector in runner_output.pooler_output.items():
            outputs += self._finish_pooled(req_id, vector)
        # (per request, per step: what does not change is looked up once)
        requests, max_model_len = self.requests, self.config.max_model_len
        running = RequestStatus.RUNNING
        all_prompt_logprobs, all_logprobs = runner_output.prompt_logprobs, runner_output.logprobs
        all_drafts = scheduler_output.scheduled_spec_decode_tokens
        all_accepted = runner_output.num_accepted_drafts
        verified_tokens, propose, free, running_reqs = (spec.verified_tokens, spec.propose,
                                                        self._free, self.running)
        finish_reason_of = FINISH_REASONS.get  # (`Request.finish_reason`, without the call)
        # A step without drafts or logprobs gives each request one token (or none, a prompt
        # chunk): most steps. A token that neither ends its request nor is its first goes to
        # the step's columns (`StepOutputs`), with no object made for it.
        plain = not spec.speculates and not all_prompt_logprobs and not all_logprobs
        plain_req_ids, plain_token_ids = step.req_ids, step.token_ids
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                     strict=True):
            request = requests.get(req_id)
            if request is None or request.status != running:
                continue  # aborted or preempted while the step ran
            output_ids, all_ids = request.output_token_ids, request.all_token_ids
            if (plain and token_id is not None and 0 < len(output_ids) < request.max_tokens - 1
                    and len(all_ids) + 1 < max_model_len
                    and token_id not in request.stop_token_ids):  # (neither first nor last)
                if request.num_output_placeholders:
                    request.num_output_placeholders -= 1
                output_ids.append(token_id)
                all_ids.append(token_id)
                plain_req_ids.append(req_id)
                plain_token_ids.append(token_id)
                continue
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            if prompt_logprobs is not None:
                prompt_logprobs = self._drop_resent_prompt_logprobs(
                    request, prompt_logprobs, scheduler_output.num_computed_before(req_id))
            if token_id is None:
                if prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(req_id, [], None, prompt_logprobs))
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            new_token_ids = verified_tokens(
                request, all_drafts.get(req_id) if all_drafts else None,
                all_accepted.get(req_id, 0) if all_accepted else 0, token_id)
            kv_transfer_params = None
            for appended, new_token_id in enumerate(new_token_ids, 1):
                request.output_token_ids.append(new_token_id)  # (append_output_token, inline)
                request.all_token_ids.append(new_token_id)
                if request.check_stop(new_token_id, max_model_len):
                    running_reqs.remove(request)
                    kv_transfer_params = free(request)
                    if appended < len(new_token_ids):  # drafts past the stop are dropped
                        new_token_ids = new_token_ids[:appended]
                    break
            outputs.append(EngineCoreOutput(
                req_id, new_token_ids,
                all_logprobs.get(req_id) if all_logprobs else None,
                prompt_logprobs, finish_reason_of(request.status), request.stop_reason,
                max(request.num_cached_tokens, 0), kv_transfer_params))
            propose(request, len(running_reqs))
        return step

    def _finish_pooled(self, req_id: str, vector) -> list[EngineCoreOutput]:
        """A pooling request whose prompt the runner has pooled: finished, its blocks freed,
        its vector its one output (none if it was aborted meanwhile). One preempted by the
        step scheduled while this one ran is taken off `waiting`: its vector is whole."""
        return [EngineCoreOutput(req_id, [], finish_reason=request.finish_reason,
                                 num_cached_tokens=max(request.num_cached_tokens, 0),
                                 pooling_output=vector)
                for request in self.finish_requests([req_id], RequestStatus.FINISHED_STOPPED)]

    def _allocate(self, request: Request, num_new: int, num_cached: int = 0,
                  cached_blocks: GroupBlocks | None = None) -> tuple[Sequence[int], ...] | None:
        """`allocate_slots` for `num_new` tokens, with a draft model's lookahead slots
        (`SpecPolicy.lookahead`) where they fit, else without them (its passes then stop short)."""
        kv = self.kv_cache_manager
        lookahead = self.spec.lookahead(request, request.num_computed_tokens + num_cached,
                                        num_new)
        if lookahead:
            block_ids = kv.allocate_slots(request, num_new + lookahead, num_cached,
                                          cached_blocks)
            if block_ids is not None:
                return block_ids
        return kv.allocate_slots(request, num_new, num_cached, cached_blocks)

    def _drop_resent_prompt_logprobs(self, request: Request, rows: LogprobsLists,
                                     start: int) -> LogprobsLists | None:
        """Drop rows sent before a preemption: a resumed request recomputes its prompt.
        Row i is prompt position start + i."""
        num_sent = self.num_prompt_logprobs_sent.get(request.request_id, 0)
        self.num_prompt_logprobs_sent[request.request_id] = max(num_sent, start + len(rows.ranks))
        skip = max(0, num_sent - start)
        if skip == 0:
            return rows
        if skip >= len(rows.ranks):
            return None
        return LogprobsLists(rows.token_ids[skip:], rows.logprobs[skip:], rows.ranks[skip:])

    # ------------------------------------------------------------------ introspection

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return self.remote_kv.add_stats(SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            **self.spec.stats(),
        ))

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Assert the docs/design.md §10 invariants that hold between steps
        (`scheduler_checks.py`)."""
        check_scheduler(self)
