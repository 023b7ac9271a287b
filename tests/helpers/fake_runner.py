"""A fake model runner for scheduler tests: a dict for the KV cache, a hash for the model.

`FakeRunner` plays the runner's side of the protocol in `aserve/core/outputs.py`. It keeps its own
copy of each request's token ids and one block table per KV cache group, built only from
`NewRequestData` and `CachedRequestData`; it "computes" a scheduled token by writing
(group, token id) into a slot → content dict in every group (block ids are shared by the groups'
KV buffers, so a block wrongly held by two groups is overwritten and caught);
and it samples `token_fn(req_id, position)` when a request's whole sequence is computed (partial
prefill chunks sample nothing), plus one prompt-logprobs row per prompt position it computes for
requests that ask (the row's token is the next prompt token). On every step it checks what a
real runner silently relies on:

- the schedule respects the token budget, `max_num_seqs` and the long-prefill threshold, and its
  batch order is cached (running) requests first, then new ones;
- no waiting request is admitted in a step that preempted one;
- the diffs rebuild exactly the scheduler's token ids, block tables and computed counts (a
  sliding group's runner table keeps stale ids where the scheduler has since put the null
  block; those positions must lie behind the window);
- no scheduled token is written to the null block;
- attention would read the right K/V: in a full group the slots of positions
  [0, computed + scheduled), in a sliding group (window W) those of [max(0, p - W + 1), p] for
  each scheduled position p, hold the request's own tokens, so a prefix hit, a resumption or a
  freed out-of-window block never leaves a read slot that nobody wrote or someone overwrote;
- every block in the prefix cache holds exactly the tokens its hash names, for its group.

With speculative decoding, a request's drafts (`scheduled_spec_decode_tokens`) are written
into their slots like any token and verified as greedy would: draft j is accepted while it is
the token the model samples at its position; the token after the accepted ones is sampled, and
the runner's computed count rolls back to the accepted positions (the scheduler's does too,
from `num_accepted_drafts`).

With `async_scheduling` on, step N's tokens reach the scheduler only after step N+1 has been
scheduled and executed (as in the engine, where N+1 runs while N's outputs are processed): the
runner's token list then runs ahead of the scheduler's by the tokens in flight.

`step_seconds(num_prefill_tokens, num_decode_tokens)`, when given, is the duration each step
reports (the scheduler's step cost model learns from it); by default steps report none.

A pooling request (`NewRequestData.pooling_params`) samples nothing: the step that computes its
last prompt token "pools" it, `pooler_output[req_id] = (first position this runner computed,
prompt length)`, so tests see whether it took a prefix hit.

`kv_worker(runner, scheduler_output)`, when given, plays a KV connector's worker side before
each step's forward: it returns the step's `KVConnectorOutput` and writes what it loads with
`load_kv` (so that the read checks see loaded K/V as a real load would leave it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from aserve.config import CacheConfig
from aserve.core.block_pool import split_cache_key
from aserve.core.hashing import hash_block_tokens
from aserve.core.kv_cache_utils import make_kv_cache_groups
from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.outputs import (
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from aserve.core.request import RequestStatus
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams

TokenFn = Callable[[str, int], int]


def fake_token(req_id: str, position: int, vocab_size: int = 1000) -> int:
    """A deterministic "model": the token a request samples at `position`."""
    digest = hashlib.sha256(f"{req_id}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % vocab_size


def hybrid_cache_config(layer_windows: list[int | None], *, block_size: int, num_blocks: int,
                        enable_prefix_caching: bool = True) -> CacheConfig:
    """A `CacheConfig` with the KV cache groups of a model whose layer i has sliding window
    `layer_windows[i]` (None: full attention), as the engine builds it."""
    return CacheConfig(block_size=block_size, num_blocks=num_blocks,
                       enable_prefix_caching=enable_prefix_caching,
                       kv_cache_groups=make_kv_cache_groups(layer_windows, block_size))


@dataclass
class _RunnerState:
    tokens: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per group
    num_computed_tokens: int
    cache_salt: str | None
    step_start: int = 0  # num_computed_tokens before this step
    pooling: bool = False  # a pooling request: pooled, never sampled
    first_computed: int = 0  # its computed count when it arrived (a prefix hit's length)


class FakeRunner:
    """Drives `scheduler` one step at a time and records what each request streamed."""

    def __init__(self, scheduler: Scheduler, token_fn: TokenFn = fake_token,
                 step_seconds: Callable[[int, int], float] | None = None,
                 kv_worker: Callable[[FakeRunner, SchedulerOutput],
                                     KVConnectorOutput | None] | None = None) -> None:
        self.scheduler = scheduler
        self.token_fn = token_fn
        self.step_seconds = step_seconds
        self.kv_worker = kv_worker
        self.block_size = scheduler.block_size
        self.windows = [g.sliding_window for g in scheduler.kv_cache_manager.groups]
        self.states: dict[str, _RunnerState] = {}
        self.slots: dict[int, tuple[int, int]] = {}  # slot → (group, token) whose K/V it holds
        # block id → (group, chained hash of the tokens it holds)
        self.block_content: dict[int, tuple[int, bytes]] = {}
        self.streamed: dict[str, list[int]] = {}  # req id → tokens from EngineCoreOutputs
        self.streamed_prompt_logprobs: dict[str, list[int]] = {}  # req id → rows' tokens
        self.finish_reasons: dict[str, str] = {}
        self.stop_reasons: dict[str, int | str | None] = {}
        self.num_steps = 0
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    # ------------------------------------------------------------------ driving

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Schedule and execute one step; return its schedule and the outputs the scheduler
        produced this step (of this step, or of the previous one with async scheduling)."""
        scheduler = self.scheduler
        output = scheduler.schedule()
        scheduler.check_invariants()
        self.check_schedule(output)
        done = (output, self.execute(output))
        if scheduler.config.async_scheduling:
            done, self.in_flight = self.in_flight, done
        outputs = list(scheduler.update_from_output(*done)) if done is not None else []
        scheduler.check_invariants()
        for out in outputs:
            self.streamed.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.new_prompt_logprobs is not None:
                rows = self.streamed_prompt_logprobs.setdefault(out.req_id, [])
                rows.extend(row[0] for row in out.new_prompt_logprobs.token_ids)
            if out.finished:
                self.finish_reasons[out.req_id] = out.finish_reason
                self.stop_reasons[out.req_id] = out.stop_reason
        self.num_steps += 1
        return output, outputs

    def run_until_done(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                self.in_flight = None  # only tokens of finished requests, which are dropped
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    # ------------------------------------------------------------------ checks

    def check_schedule(self, output: SchedulerOutput) -> None:
        scheduler, config = self.scheduler, self.scheduler.config
        kv = scheduler.kv_cache_manager
        scheduled = output.num_scheduled_tokens
        assert output.total_num_scheduled_tokens == sum(scheduled.values())
        assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(scheduled) <= config.max_num_seqs
        assert len(scheduler.running) <= config.max_num_seqs
        assert list(scheduled) == ([c.req_id for c in output.scheduled_cached_reqs]
                                   + [n.req_id for n in output.scheduled_new_reqs])
        assert not (output.finished_req_ids | output.preempted_req_ids) & set(scheduled)
        if output.preempted_req_ids:
            assert not output.scheduled_new_reqs, "admitted a request in a preempting step"
        for req_id, num_tokens in scheduled.items():
            request = scheduler.requests[req_id]
            assert num_tokens >= 1
            if config.prefill.long_prefill_token_threshold:
                assert num_tokens <= config.prefill.long_prefill_token_threshold
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= (
                request.num_tokens + request.num_output_placeholders
                + len(output.scheduled_spec_decode_tokens.get(req_id, ())))
            drafts = output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:  # a decode's token and its drafts, nothing else
                assert num_tokens == 1 + len(drafts)
                assert request.num_computed_tokens == request.num_tokens + len(drafts)
            for group_id, block_ids in enumerate(kv.get_block_ids(req_id)):
                covered = len(block_ids) * self.block_size
                assert covered >= request.num_computed_tokens, (
                    f"group {group_id}'s blocks do not cover {request}")

    def check_prefix_cache_content(self) -> None:
        for key, block in self.scheduler.kv_cache_manager.block_pool.cached_blocks.items():
            block_hash, group_id = split_cache_key(key)
            assert self.block_content.get(block.block_id) == (group_id, block_hash), (
                f"{block} is in the prefix cache but holds other (or no) K/V")

    # ------------------------------------------------------------------ the runner's side

    def load_kv(self, req_id: str, start: int, end: int) -> None:
        """Write the K/V of the request's tokens [start, end) into its blocks, in every group,
        as a KV connector's load does (not for the null block)."""
        request, size = self.scheduler.requests[req_id], self.block_size
        tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        parent = None
        for index in range(end // size):
            extra = (request.cache_salt,) if index == 0 and request.cache_salt is not None else None
            tokens = request.all_token_ids[index * size:(index + 1) * size]
            parent = hash_block_tokens(parent, tokens, extra)
            for group_id, table in enumerate(tables):
                if index * size >= start and table[index] != 0:
                    self.block_content[table[index]] = (group_id, parent)
        for group_id, table in enumerate(tables):
            for position in range(start, end):
                block_id = table[position // size]
                if block_id != 0:
                    self.slots[block_id * size + position % size] = (
                        group_id, request.all_token_ids[position])

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        kv_output = self.kv_worker(self, output) if self.kv_worker is not None else None
        self._update_states(output)
        req_ids = list(output.num_scheduled_tokens)
        prompt_logprobs = {}
        spec = output.scheduled_spec_decode_tokens
        for req_id in req_ids:
            rows = self._compute(req_id, output.num_scheduled_tokens[req_id],
                                 spec.get(req_id, []))
            if rows is not None:
                prompt_logprobs[req_id] = rows
        for req_id in req_ids:  # all writes land before any read, as layer by layer on a GPU
            self._check_reads(req_id)
        self.check_prefix_cache_content()
        accepted = {req_id: self._verify(req_id, spec[req_id]) for req_id in req_ids
                    if spec.get(req_id)}
        sampled: list[int | None] = []
        pooled = {}
        for req_id in req_ids:
            state = self.states[req_id]
            token_id = None
            if state.num_computed_tokens == len(state.tokens) and state.pooling:
                pooled[req_id] = (state.first_computed, len(state.tokens))
            elif state.num_computed_tokens == len(state.tokens):
                token_id = self.token_fn(req_id, len(state.tokens))
                state.tokens.append(token_id)
            sampled.append(token_id)
        seconds = 0.0
        if self.step_seconds is not None:
            num_decode = output.num_decode_tokens
            seconds = self.step_seconds(output.total_num_scheduled_tokens - num_decode,
                                        num_decode)
        asked = output.num_draft_tokens
        drafted = {req_id: self._draft(req_id, asked[req_id])
                   for req_id, token_id in zip(req_ids, sampled)
                   if token_id is not None and asked.get(req_id)}
        return ModelRunnerOutput(req_ids, sampled, prompt_logprobs=prompt_logprobs,
                                 forward_seconds=seconds, kv_connector_output=kv_output,
                                 num_accepted_drafts=accepted, draft_token_ids=drafted,
                                 pooler_output=pooled)

    def _draft(self, req_id: str, count: int) -> list[int]:
        """A draft model's `count` drafts after a sampled token (at most the scheduler's
        `spec.num_lookahead`):
        the model's own next tokens but every third position, which is off by one, as far as
        the request's blocks reach (the scheduler's lookahead, where it fit), within
        max_model_len."""
        state, size = self.states[req_id], self.block_size
        start = len(state.tokens) - 1  # the sampled token's position: the first pass writes it
        drafts = []
        assert count <= self.scheduler.spec.num_lookahead
        for j in range(count):
            position = start + j
            if position >= self.scheduler.config.max_model_len - 1:
                break
            if any(position // size >= len(table) or table[position // size] == 0
                   for table in state.block_ids):
                break  # (its lookahead slots did not fit: the passes stop here, as the runner's)
            token = self.token_fn(req_id, position + 1)
            drafts.append(token + 1 if (position + 1) % 3 == 0 else token)
        return drafts

    def _verify(self, req_id: str, drafts: list[int]) -> int:
        """Greedy verification of the drafts appended by `_compute`: keep the leading ones the
        model samples at their positions, drop the rest, roll the computed count back."""
        state = self.states[req_id]
        first = len(state.tokens) - len(drafts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.token_fn(req_id,
                                                                           first + accepted):
            accepted += 1
        del state.tokens[first + accepted:]
        state.num_computed_tokens = len(state.tokens)
        return accepted

    def _update_states(self, output: SchedulerOutput) -> None:
        for req_id in output.finished_req_ids | output.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent whole twice"
            salt = self.scheduler.requests[new.req_id].cache_salt
            assert len(new.block_ids) == len(self.windows)
            self.states[new.req_id] = _RunnerState(
                new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                new.sampling_params, [list(ids) for ids in new.block_ids],
                new.num_computed_tokens, salt, pooling=new.pooling_params is not None,
                first_computed=new.num_computed_tokens)
        for cached in output.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            assert len(cached.new_block_ids) == len(self.windows)
            for table, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                table.extend(new_ids)

    def _compute(self, req_id: str, num_tokens: int, drafts: list[int] = ()
                 ) -> LogprobsLists | None:
        """Write the K/V of the scheduled tokens (the drafts' too, appended to the runner's
        tokens until `_verify`); return the prompt-logprobs rows they give."""
        state, request = self.states[req_id], self.scheduler.requests[req_id]
        known = request.num_tokens  # the runner may hold tokens still in flight to the scheduler
        assert state.tokens[:known] == request.all_token_ids, f"runner, scheduler differ: {req_id}"
        assert len(state.tokens) <= known + request.num_output_placeholders
        if drafts:
            assert len(state.tokens) == known and not request.num_output_placeholders
            state.tokens.extend(drafts)
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        assert end == request.num_computed_tokens <= len(state.tokens)
        self._check_tables(req_id, start, end)
        state.step_start = start
        size = self.block_size
        for group_id, table in enumerate(state.block_ids):
            for position in range(start, end):
                block_id = table[position // size]
                assert block_id != 0, f"{req_id} writes position {position} to the null block"
                self.block_content.pop(block_id, None)
                self.slots[block_id * size + position % size] = (group_id, state.tokens[position])
        state.num_computed_tokens = end
        parent = None
        for index in range(end // size):  # record what each full block now holds
            extra = (state.cache_salt,) if index == 0 and state.cache_salt is not None else None
            parent = hash_block_tokens(parent, state.tokens[index * size:(index + 1) * size], extra)
            if index >= start // size:
                for group_id, table in enumerate(state.block_ids):
                    self.block_content[table[index]] = (group_id, parent)
        if state.sampling_params.prompt_logprobs is None:
            return None
        positions = range(start, min(end, state.num_prompt_tokens - 1))
        if not positions:
            return None
        return LogprobsLists([[state.tokens[p + 1]] for p in positions],
                             [[-float(p)] for p in positions], [1] * len(positions))

    def _check_tables(self, req_id: str, start: int, end: int) -> None:
        """The runner's tables match the scheduler's, but where it has since nulled a block
        behind the window of `start` (the runner keeps the stale id there)."""
        size = self.block_size
        tables = self.states[req_id].block_ids
        for group_id, (table, ids) in enumerate(zip(
                tables, self.scheduler.kv_cache_manager.get_block_ids(req_id), strict=True)):
            window = self.windows[group_id]
            assert len(table) == len(ids) and len(table) * size >= end, (req_id, group_id)
            for index, (runner_id, block_id) in enumerate(zip(table, ids, strict=True)):
                if block_id == 0:
                    assert window is not None and (index + 1) * size <= start - window + 1, (
                        f"{req_id}: group {group_id} nulled block {index} inside its window")
                else:
                    assert runner_id == block_id, f"{req_id}: group {group_id} tables differ"

    def _check_reads(self, req_id: str) -> None:
        state, size = self.states[req_id], self.block_size
        for group_id, table in enumerate(state.block_ids):
            window = self.windows[group_id]
            first = 0 if window is None else max(0, state.step_start - window + 1)
            for position in range(first, state.num_computed_tokens):
                slot = table[position // size] * size + position % size
                assert self.slots.get(slot) == (group_id, state.tokens[position]), (
                    f"{req_id} would attend to wrong K/V at position {position} "
                    f"in group {group_id}")
