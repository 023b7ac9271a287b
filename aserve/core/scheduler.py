"""The scheduler: one token budget per step, spent on running requests first, then waiting ones.

There are no prefill and decode phases. A request has `num_computed_tokens`; a step gives it
`num_scheduled_tokens` more (a whole prompt, a chunk of one, or the one token sampled last step).
That covers chunked prefill, prefix-cache hits and resumption after preemption alike.

    schedule():  running  ──(budget, blocks; preempt lowest priority when blocks run out)──┐
                 waiting  ──(if nothing was preempted: prefix hit, blocks, max_num_seqs)───┤
                                                                     SchedulerOutput ◄─────┘
    update_from_output(): append sampled tokens, check stops, free finished requests' blocks.

A step that carries decodes keeps them flowing: its prefill tokens are capped at what costs
`max_prefill_step_ratio` times a step's fixed cost, by a cost model fitted to the steps that
ran (`StepCostModel`, fed by `update_from_output` from the runner's seconds); with many
streams decoding, also at what keeps the step within `max_mixed_step_ratio` times those decodes
alone, unless the prompts pending need more. A step without decodes, or with at most
`prefill_first_streams` streams decoding, has the whole budget for prefill.

Blocks are per KV cache group (full attention, sliding windows): the `KVCacheManager` answers
for every group at once, so a request is admitted, grown or preempted as a whole, and block
ids travel as one list per group.

With a KV connector (`core/kv_connector.py`, injected by the engine) a waiting request may
have KV to load: it gets its blocks, waits in `waiting_for_remote_kvs` (status
WAITING_FOR_REMOTE_KVS) while the workers load them, and goes back to the front of the queue
once loaded (or, after a failed load, to be computed from scratch). Blocks the workers still
use after their request ended (sent to a peer; an abort while loading) stay allocated in
`held_for_workers` until the workers report them done.
"""

from __future__ import annotations

from collections.abc import Iterable

from aserve.config import CacheConfig, SchedulerConfig
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.kv_cache_utils import max_blocks_per_request
from aserve.core.kv_connector import KVConnectorScheduler
from aserve.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from aserve.core.remote_kv import RemoteKVScheduling
from aserve.core.request import Request, RequestStatus
from aserve.core.request_queue import create_request_queue
from aserve.core.step_cost import StepBudget, StepCostModel, prefill_token_cap


class Scheduler(RemoteKVScheduling):
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
        self.running: list[Request] = []
        # Requests the runner still holds but must drop: finished or aborted since last step.
        self.finished_req_ids: set[str] = set()
        # Per request asking for prompt logprobs: prompt positions whose rows went out already.
        self.num_prompt_logprobs_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.step_cost = StepCostModel()
        self._last_output: SchedulerOutput | None = None
        self.connector = kv_connector
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # their blocks being loaded
        self.loaded: list[Request] = []  # loaded, waiting to run (holding their blocks)
        self.held_for_workers: dict[str, Request] = {}  # finished; blocks still in use
        self.num_held_blocks = 0  # the blocks of held_for_workers (every group, no null block)
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.num_kv_load_failures = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_seconds = 0.0

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
            elif loading:
                del self.waiting_for_remote_kvs[req_id]
            elif request in self.loaded:
                self.loaded.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request, loading)
            finished.append(request)
        return finished

    def _free(self, request: Request, loading: bool = False) -> dict | None:
        """Forget a finished request; free its blocks unless the workers still use them
        (loading into them, or the connector sends them: `held_for_workers`). Returns the
        connector's `kv_transfer_params` for the client."""
        req_id, params, delay = request.request_id, None, loading
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id))
            delay = delay or delay_free
        if delay:
            self.held_for_workers[req_id] = request
            self.num_held_blocks += self._num_blocks_of(req_id)
        else:
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(req_id)
        self.num_prompt_logprobs_sent.pop(req_id, None)
        del self.requests[req_id]
        return params

    def _num_blocks_of(self, req_id: str) -> int:
        return sum(len(ids) - ids.count(0) for ids in self.kv_cache_manager.get_block_ids(req_id))

    @property
    def num_unfinished_requests(self) -> int:
        return (len(self.waiting) + len(self.running) + len(self.waiting_for_remote_kvs)
                + len(self.loaded))

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def has_kv_transfers(self) -> bool:
        """Finished requests whose blocks the workers still send or load into."""
        return bool(self.held_for_workers)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        budget = StepBudget(self.config.max_num_batched_tokens, self._max_prefill_tokens())
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, tuple[list[int], ...]] = {}
        preempted: list[Request] = []

        self._schedule_running(budget, num_scheduled, new_block_ids, preempted)
        resumed_or_new: list[Request] = []
        if not preempted:
            self._schedule_waiting(budget, num_scheduled, resumed_or_new)

        output = self._make_output(num_scheduled, new_block_ids, resumed_or_new, preempted)
        for req_id, num_tokens in num_scheduled.items():
            request = self.requests[req_id]
            if not _is_prefill(request, request.num_computed_tokens, num_tokens):
                output.num_decode_tokens += 1
            request.num_computed_tokens += num_tokens
            if self.config.async_scheduling and request.num_computed_tokens == (
                    request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1  # it samples: a token is on its way
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._last_output = output
        return output

    def _max_prefill_tokens(self) -> int:
        """Prefill tokens this step may carry (`step_cost.prefill_token_cap`: the whole
        budget without decodes or with few, else what the measured step cost allows)."""
        num_decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        return prefill_token_cap(self.config, self.step_cost, num_decoding,
                                 self._pending_within, self.block_size)

    def _pending_within(self, limit: int) -> int:
        """Prompt tokens of the prompts not prefilled yet, counted up to `limit`: a running
        prefill's whole prompt past its cached prefix (not only its rest: a prompt drained at
        pending / steps a step then goes at one rate and ends within those steps, where its
        rest / steps would shrink every step and never end), a waiting prompt's past its
        cached prefix."""
        pending = 0
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                pending += request.num_prompt_tokens - max(0, request.num_cached_tokens)
        for request in self.waiting:
            if pending >= limit:
                break
            pending += request.num_tokens - self.kv_cache_manager.get_computed_blocks(request)[1]
        return min(pending, limit)

    def _num_tokens_to_schedule(self, request: Request, num_computed: int,
                                budget: StepBudget) -> int:
        """Tokens to give `request` this step: 0 when it must wait for tokens in flight (or
        for the prefill budget of a later step)."""
        num_pending = request.num_output_placeholders
        if num_pending and (request.num_output_tokens + num_pending >= request.max_tokens
                            or request.num_tokens + num_pending >= self.config.max_model_len
                            or self.config.max_batches_in_flight > 1):
            return 0  # its token in flight is its last one, or the next batch needs it
        num_new = request.num_tokens + num_pending - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, budget.limit(_is_prefill(request, num_computed, num_new)))

    def _schedule_running(self, budget: StepBudget, num_scheduled: dict[str, int],
                          new_block_ids: dict[str, tuple[list[int], ...]],
                          preempted: list[Request]) -> None:
        if self.config.policy == "priority":
            # Highest priority first, so a victim (the lowest) is never one already scheduled
            # this step: its newly full blocks are in the prefix cache, K/V not yet computed.
            self.running.sort(key=Request.sort_key)
        index = 0
        while index < len(self.running) and budget.num_tokens > 0:
            request = self.running[index]
            num_new = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:
                    num_given = num_scheduled.pop(victim.request_id)
                    budget.spend(-num_given, _is_prefill(victim, victim.num_computed_tokens,
                                                         num_given))
                new_block_ids.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                index = self.running.index(request)
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if block_ids is None:
                continue  # `request` itself was preempted; `index` now points past it
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = block_ids
            budget.spend(num_new, _is_prefill(request, request.num_computed_tokens, num_new))
            index += 1

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":  # on a tie, the one admitted last
            return max(reversed(self.running), key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is dropped and sampled again
        request.num_external_computed_tokens = 0  # loaded K/V gone too: recomputed
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, budget: StepBudget, num_scheduled: dict[str, int],
                          admitted: list[Request]) -> None:
        self._admit_loaded(budget, num_scheduled, admitted)
        kv = self.kv_cache_manager
        while (len(self.waiting) and budget.num_tokens > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            cached_blocks, num_cached = kv.get_computed_blocks(request)
            num_external = self._num_external_tokens(request, num_cached)
            if num_external:
                if not self._start_remote_load(request, num_cached, cached_blocks,
                                               num_external):
                    break
                continue
            num_new = self._num_tokens_to_schedule(request, num_cached, budget)
            if num_new <= 0 or kv.allocate_slots(request, num_new, num_cached,
                                                 cached_blocks) is None:
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id), 0)
                if not request.kv_load_failed and request.sampling_params.prompt_logprobs is None:
                    self.external_prefix_cache_queries += request.num_tokens  # (asked: none)
            self.waiting.pop()
            self._admit(request, num_cached, num_new, budget, num_scheduled, admitted)

    def _admit(self, request: Request, num_computed: int, num_new: int, budget: StepBudget,
               num_scheduled: dict[str, int], admitted: list[Request]) -> None:
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        admitted.append(request)
        num_scheduled[request.request_id] = num_new
        budget.spend(num_new, _is_prefill(request, num_computed, num_new))

    def _make_output(self, num_scheduled: dict[str, int],
                     new_block_ids: dict[str, tuple[list[int], ...]],
                     admitted: list[Request], preempted: list[Request]) -> SchedulerOutput:
        kv = self.kv_cache_manager
        cached = [
            CachedRequestData(req_id, block_ids, self.requests[req_id].num_computed_tokens)
            for req_id, block_ids in new_block_ids.items()
        ]
        new = [
            NewRequestData(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                           r.sampling_params, kv.get_block_ids(r.request_id),
                           r.num_computed_tokens)
            for r in admitted
        ]
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in preempted},
        )

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if runner_output.kv_connector_output is not None:
            self._update_from_kv_output(runner_output.kv_connector_output)
        if scheduler_output.total_num_scheduled_tokens:
            self.step_cost.record(scheduler_output.total_num_scheduled_tokens,
                                  runner_output.forward_seconds)
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                     strict=True):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if prompt_logprobs is not None:
                prompt_logprobs = self._drop_resent_prompt_logprobs(
                    request, prompt_logprobs, _num_computed_before(scheduler_output, req_id))
            if token_id is None:
                if prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(req_id, [], None, prompt_logprobs))
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            request.append_output_token_ids([token_id])
            kv_transfer_params = None
            if self._check_stop(request, token_id):
                self.running.remove(request)
                kv_transfer_params = self._free(request)
            outputs.append(EngineCoreOutput(
                req_id, [token_id], runner_output.logprobs.get(req_id), prompt_logprobs,
                request.finish_reason, request.stop_reason, max(request.num_cached_tokens, 0),
                kv_transfer_params))
        return outputs

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

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set a finished status when `token_id` ends the request; return whether it did."""
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH
        elif (request.num_output_tokens < request.sampling_params.min_tokens
              and request.sampling_params.compiled_grammar is None):
            return False  # (a constrained request samples a stop token this early only when
            # its grammar has ended: nothing else may follow, and it ends there)
        elif token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            params = request.sampling_params
            if params.ignore_eos or token_id not in params.eos_token_ids:
                request.stop_reason = token_id  # a stop token, not EOS
        return request.is_finished

    # ------------------------------------------------------------------ introspection

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            num_kv_load_failures=self.num_kv_load_failures,
            kv_transfer_bytes=self.kv_transfer_bytes,
            kv_transfer_seconds=self.kv_transfer_seconds,
            num_waiting_for_remote_kvs=len(self.waiting_for_remote_kvs),
            num_held_blocks=self.num_held_blocks,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Assert the docs/design.md §10 invariants that hold between steps."""
        kv = self.kv_cache_manager
        kv.check_invariants()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is running twice"
        remote_ids = set(self.waiting_for_remote_kvs) | {r.request_id for r in self.loaded}
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert not (running_ids | waiting_ids) & remote_ids, "a loading request is queued"
        assert running_ids | waiting_ids | remote_ids == set(self.requests), (
            "request table out of sync")
        assert not set(self.held_for_workers) & set(self.requests), "a held request runs"
        assert len(self.running) <= self.config.max_num_seqs, "too many running requests"
        max_blocks = [max_blocks_per_request(g, self.config.max_model_len,
                                             self.config.max_num_batched_tokens)
                      for g in kv.groups]
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            for group_id, block_ids in enumerate(kv.get_block_ids(request.request_id)):
                covered = len(block_ids) * self.block_size
                assert request.num_computed_tokens <= covered, (
                    f"group {group_id}'s blocks do not cover {request}")
                num_held = sum(1 for block_id in block_ids if block_id != 0)
                assert num_held <= max_blocks[group_id], (
                    f"{request} holds {num_held} blocks of group {group_id}")
            assert request.num_computed_tokens <= (
                request.num_tokens + request.num_output_placeholders), request
            assert request.num_output_placeholders <= 2 * self.config.async_scheduling, request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert not kv.holds_blocks(request.request_id), f"waiting {request} holds blocks"
            assert request.num_output_placeholders == 0, request
        for request in self.loaded:
            assert request.status == RequestStatus.WAITING and request.num_external_computed_tokens
            assert kv.holds_blocks(request.request_id), f"loaded {request} holds no blocks"
        for request in self.waiting_for_remote_kvs.values():
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, request
            num_loaded = request.num_computed_tokens + request.num_external_computed_tokens
            for block_ids in kv.get_block_ids(request.request_id):
                assert len(block_ids) * self.block_size >= num_loaded, request
        for req_id in self.held_for_workers:
            assert kv.holds_blocks(req_id), f"held {req_id} holds no blocks"
        assert self.num_held_blocks == sum(map(self._num_blocks_of, self.held_for_workers))
        output = self._last_output
        if output is not None:
            assert output.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
            assert len(output.num_scheduled_tokens) <= self.config.max_num_seqs


def _is_prefill(request: Request, num_computed: int, num_new: int) -> bool:
    """Whether `num_new` tokens from `num_computed` on are a prefill chunk (prompt, or the
    recomputation of a preempted request), not a decode's one token past the prompt."""
    return num_new > 1 or num_computed < request.num_prompt_tokens


def _num_computed_before(scheduler_output: SchedulerOutput, req_id: str) -> int:
    """How many tokens `req_id` had computed when `scheduler_output` was made."""
    for data in scheduler_output.scheduled_cached_reqs:
        if data.req_id == req_id:
            return data.num_computed_tokens
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id == req_id:
            return new.num_computed_tokens
    raise KeyError(req_id)
