"""Scheduler: budget, chunked prefill, prefix hits, preemption, stops, aborts, admission order.

Every test drives the scheduler through `FakeRunner` (tests/helpers/fake_runner.py), which
checks the scheduler's invariants, the per-step limits and the K/V every request would read after
each step. Block size is 4 throughout; prompts are runs of distinct token ids, so only equal
prompts share blocks. Unless a test says otherwise the fake model samples `100 + position`, never
EOS.
"""

from __future__ import annotations

import pytest
from helpers.fake_runner import FakeRunner
from helpers.requests import make_request as helper_request

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler

BS = 4
EOS = 0


def make_scheduler(num_blocks: int = 64, *, budget: int = 64, max_num_seqs: int = 16,
                   max_model_len: int = 64, threshold: int = 0, policy: str = "fcfs",
                   caching: bool = True, async_scheduling: bool = False,
                   max_batches_in_flight: int = 1) -> Scheduler:
    """A one-group scheduler with `num_blocks` usable blocks (the pool has one more: block 0,
    the null block)."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        max_model_len=max_model_len,
                        prefill=PrefillPolicy(long_prefill_token_threshold=threshold),
                        policy=policy, async_scheduling=async_scheduling,
                        max_batches_in_flight=max_batches_in_flight),
        CacheConfig(block_size=BS, num_blocks=num_blocks + 1, enable_prefix_caching=caching))


def make_request(req_id: str, prompt: list[int], **kwargs) -> Request:
    return helper_request(req_id, prompt, eos_token_ids=(EOS,), **kwargs)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def counting(req_id: str, position: int) -> int:
    return 100 + position


def scripted(overrides: dict[tuple[str, int], int]):
    """`counting`, except at the (request id, position) pairs given."""
    return lambda req_id, position: overrides.get((req_id, position), counting(req_id, position))


def make_runner(scheduler: Scheduler, *requests: Request, token_fn=counting) -> FakeRunner:
    for request in requests:
        scheduler.add_request(request)
    scheduler.check_invariants()
    return FakeRunner(scheduler, token_fn)


def schedule_of(runner: FakeRunner) -> list[tuple[str, int]]:
    """One step; its schedule in batch order."""
    output, _ = runner.step()
    return list(output.num_scheduled_tokens.items())


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks
    assert pool.num_free_blocks == pool.num_blocks - 1  # all but the null block
    assert not any(m.req_to_blocks for m in scheduler.kv_cache_manager.coordinator.managers)


def assert_finished_cleanly(runner: FakeRunner) -> None:
    """Run to the end: every block free, and the runner told to drop every request."""
    runner.run_until_done()
    scheduler = runner.scheduler
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    assert_all_blocks_free(scheduler)
    last, _ = runner.step()
    assert last.is_empty and not runner.states
    scheduler.check_invariants()


# ---------------------------------------------------------------------- token budget


def test_long_prompt_is_chunked_by_the_budget_and_mixed_with_decodes() -> None:
    scheduler = make_scheduler(budget=8)
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), arrival=0),
                         make_request("b", tokens(50, 20), arrival=1))
    output, _ = runner.step()
    assert list(output.num_scheduled_tokens.items()) == [("a", 3), ("b", 5)]
    assert [(n.req_id, n.num_computed_tokens) for n in output.scheduled_new_reqs] == [
        ("a", 0), ("b", 0)]
    assert runner.streamed == {"a": [103]}  # b's chunk samples nothing
    output, _ = runner.step()
    assert list(output.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert not output.scheduled_new_reqs
    assert [(c.req_id, c.num_computed_tokens) for c in output.scheduled_cached_reqs] == [
        ("a", 3), ("b", 5)]
    assert schedule_of(runner) == [("a", 1), ("b", 7)]  # b: 19 of 20 computed
    assert "b" not in runner.streamed
    assert schedule_of(runner) == [("a", 1), ("b", 1)]  # b's last prompt token, then it samples
    assert runner.streamed["b"] == [120]
    assert schedule_of(runner) == [("a", 1), ("b", 1)]
    assert runner.streamed == {"a": [103, 104, 105, 106, 107], "b": [120, 121]}
    assert_finished_cleanly(runner)


def test_decode_tokens_are_counted_apart_from_prefill_chunks() -> None:
    """A step's decodes are one-token steps past the prompt; a prompt's last one-token chunk,
    or a resumed request's recomputation, is prefill."""
    scheduler = make_scheduler(budget=8)
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), arrival=0),
                         make_request("b", tokens(50, 20), arrival=1))
    decodes = [runner.step()[0].num_decode_tokens for _ in range(5)]
    # a: 3, 1, 1, 1, 1; b: 5, 7, 7, 1 (its last prompt token), 1 (its first decode)
    assert decodes == [0, 1, 1, 1, 2]
    assert_finished_cleanly(runner)


def test_async_decode_with_a_token_in_flight_counts_as_a_decode() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", tokens(1, 6), max_tokens=5, ignore_eos=True))
    assert scheduler.schedule().num_decode_tokens == 0  # the prompt
    assert scheduler.schedule().num_decode_tokens == 1  # its token is still in flight


def test_running_requests_spend_the_budget_before_waiting_ones_are_admitted() -> None:
    scheduler = make_scheduler(budget=2)
    runner = make_runner(scheduler, make_request("a", tokens(1, 1)),
                         make_request("b", tokens(10, 1)))
    assert schedule_of(runner) == [("a", 1), ("b", 1)]
    scheduler.add_request(make_request("c", tokens(20, 3)))
    for _ in range(3):
        assert schedule_of(runner) == [("a", 1), ("b", 1)]
        assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.finish_requests(["b"])
    assert schedule_of(runner) == [("a", 1), ("c", 1)]
    assert_finished_cleanly(runner)


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    scheduler = make_scheduler(budget=64, threshold=5)
    runner = make_runner(scheduler, make_request("a", tokens(1, 12), max_tokens=2),
                         make_request("b", tokens(50, 3), max_tokens=3))
    assert schedule_of(runner) == [("a", 5), ("b", 3)]
    assert schedule_of(runner) == [("a", 5), ("b", 1)]
    assert schedule_of(runner) == [("a", 2), ("b", 1)]
    assert schedule_of(runner) == [("a", 1)]
    assert runner.finish_reasons == {"a": "length", "b": "length"}
    assert_finished_cleanly(runner)


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = make_runner(scheduler, *(make_request(r, tokens(10 * i + 1, 2), max_tokens=2)
                                      for i, r in enumerate("abc")))
    assert schedule_of(runner) == [("a", 2), ("b", 2)]
    assert len(scheduler.running) == 2 and [r.request_id for r in scheduler.waiting] == ["c"]
    assert schedule_of(runner) == [("a", 1), ("b", 1)]  # both finish: max_tokens
    output, _ = runner.step()
    assert list(output.num_scheduled_tokens.items()) == [("c", 2)]
    assert output.finished_req_ids == {"a", "b"}
    assert_finished_cleanly(runner)


# ---------------------------------------------------------------------- prefix caching


def test_same_prompt_hits_the_cached_full_blocks_and_counts_stats() -> None:
    scheduler = make_scheduler()
    prompt = tokens(1, 10)
    runner = make_runner(scheduler, make_request("a", prompt, max_tokens=3))
    assert schedule_of(runner) == [("a", 10)]
    (a_blocks,) = scheduler.kv_cache_manager.get_block_ids("a")
    scheduler.add_request(make_request("b", prompt, max_tokens=3))
    output, outputs = runner.step()
    assert list(output.num_scheduled_tokens.items()) == [("a", 1), ("b", 2)]
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 8  # two full blocks of the ten tokens
    (b_blocks,) = new.block_ids
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] not in a_blocks
    assert scheduler.requests["b"].num_cached_tokens == 8
    assert {o.req_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 8}
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in a_blocks[:2]] == [2, 2]
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert stats.kv_cache_usage == pytest.approx(4 / 64)  # a: 3 blocks, b: 1 of its own
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == runner.streamed["b"] == [110, 111, 112]


def test_a_blocked_waiting_request_counts_its_prefix_lookup_once() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    runner = make_runner(scheduler, make_request("a", tokens(1, 8), max_tokens=8))
    runner.step()  # a holds 2 of the 4 blocks and will need a third
    # b shares a's first block and needs two more: it waits while a grows to 4 blocks
    scheduler.add_request(make_request("b", tokens(1, 4) + tokens(60, 8), max_tokens=1))
    for _ in range(3):
        assert not runner.step()[0].scheduled_new_reqs
    assert_finished_cleanly(runner)
    stats = scheduler.make_stats()
    # a: 8 tokens looked up, 0 found; b: 12 looked up once, its first block (of a's) found
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 + 12, 4)


def test_cached_blocks_outlive_their_request_and_are_reused() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 9), max_tokens=1))
    runner.step()
    a_blocks = [1, 2, 3]
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([],)
    scheduler.add_request(make_request("b", tokens(1, 9), max_tokens=1))
    output, _ = runner.step()
    assert output.finished_req_ids == {"a"}
    assert output.num_scheduled_tokens == {"b": 1}
    assert output.scheduled_new_reqs[0].block_ids[0][:2] == a_blocks[:2]
    assert_finished_cleanly(runner)


def test_prefix_hit_never_covers_the_whole_prompt() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 8), max_tokens=1))
    runner.step()
    scheduler.add_request(make_request("b", tokens(1, 8), max_tokens=1))
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"b": 4}  # the last full block is computed again
    assert output.scheduled_new_reqs[0].num_computed_tokens == 4
    assert_finished_cleanly(runner)


def test_no_hits_with_prefix_caching_disabled() -> None:
    scheduler = make_scheduler(caching=False)
    runner = make_runner(scheduler, make_request("a", tokens(1, 9), max_tokens=1))
    runner.step()
    scheduler.add_request(make_request("b", tokens(1, 9), max_tokens=1))
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"b": 9}
    assert scheduler.make_stats().prefix_cache_hits == 0
    assert not scheduler.kv_cache_manager.block_pool.cached_blocks
    assert_finished_cleanly(runner)


def test_reset_prefix_cache_is_refused_while_blocks_are_held_then_forgets_all() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 9), max_tokens=2))
    runner.step()
    assert scheduler.reset_prefix_cache() is False
    assert_finished_cleanly(runner)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", tokens(1, 9), max_tokens=1))
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"b": 9}
    assert_finished_cleanly(runner)


# ---------------------------------------------------------------------- preemption


def test_fcfs_preempts_the_latest_running_request_and_resumes_it_with_its_outputs() -> None:
    # 4 blocks of 4 tokens: a and b (prompts of 4) each take a 2nd block at position 4 and need
    # a 3rd at position 8, when none is left.
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    runner = make_runner(scheduler, make_request("a", tokens(1, 4), arrival=0, max_tokens=7),
                         make_request("b", tokens(50, 4), arrival=1, max_tokens=10))
    for _ in range(5):
        runner.step()
    b = scheduler.requests["b"]
    b_outputs = list(b.output_token_ids)
    assert b_outputs == [104, 105, 106, 107, 108]
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    output, _ = runner.step()  # a needs block 3 for position 8: b goes
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and scheduler.make_stats().num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("b") == ([],)
    assert sum(blk.ref_cnt for blk in scheduler.kv_cache_manager.block_pool.blocks) == 3
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert scheduler.waiting.peek() is b

    output, _ = runner.step()  # a finishes (max_tokens 7); b does not fit yet
    assert output.num_scheduled_tokens == {"a": 1} and not output.scheduled_new_reqs
    output, _ = runner.step()
    assert output.finished_req_ids == {"a"}
    (resumed,) = output.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.output_token_ids == b_outputs
    assert resumed.num_computed_tokens == 4  # its prompt block survived in the prefix cache
    assert output.num_scheduled_tokens == {"b": 5}
    assert_finished_cleanly(runner)
    assert runner.streamed["b"] == [100 + p for p in range(4, 14)]  # as if never preempted
    assert runner.finish_reasons == {"a": "length", "b": "length"}


def test_fcfs_request_preempts_itself_when_it_is_the_latest() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    runner = make_runner(scheduler, make_request("a", tokens(1, 4), arrival=0, max_tokens=4),
                         make_request("b", tokens(50, 7), arrival=1, max_tokens=3))
    assert schedule_of(runner) == [("a", 4), ("b", 7)]
    assert schedule_of(runner) == [("a", 1), ("b", 1)]  # a takes the last free block
    output, _ = runner.step()  # b needs a block for position 8: it is the latest, so it goes
    assert output.num_scheduled_tokens == {"a": 1} and output.preempted_req_ids == {"b"}
    assert scheduler.waiting.peek().request_id == "b"
    assert_finished_cleanly(runner)
    assert runner.streamed["b"] == [107, 108, 109]


def test_priority_preempts_largest_priority_value_then_latest_arrival() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, policy="priority")
    runner = make_runner(
        scheduler,
        make_request("low-early", tokens(1, 4), arrival=0, priority=2, max_tokens=8),
        make_request("high", tokens(20, 4), arrival=1, priority=0, max_tokens=8),
        make_request("low-late", tokens(40, 4), arrival=2, priority=2, max_tokens=8))
    assert schedule_of(runner) == [("high", 4), ("low-early", 4), ("low-late", 4)]
    output, _ = runner.step()  # all three need a 2nd block at position 4; one is free
    assert output.preempted_req_ids == {"low-late"}
    assert output.num_scheduled_tokens == {"high": 1, "low-early": 1}
    for _ in range(3):
        runner.step()
    output, _ = runner.step()  # high needs a 3rd block at position 8
    assert output.preempted_req_ids == {"low-early"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert [r.request_id for r in scheduler.waiting] == ["low-early", "low-late"]
    assert scheduler.make_stats().num_preemptions == 2
    assert_finished_cleanly(runner)
    for req_id, start in [("low-early", 4), ("high", 4), ("low-late", 4)]:
        assert runner.streamed[req_id] == [100 + p for p in range(start, start + 8)]


def test_priority_tie_preempts_the_request_admitted_last() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, policy="priority")
    runner = make_runner(scheduler, make_request("first", tokens(1, 4), max_tokens=7),
                         make_request("second", tokens(50, 4), max_tokens=7))  # same key
    for _ in range(5):
        runner.step()
    output, _ = runner.step()  # first needs a 3rd block at position 8
    assert output.preempted_req_ids == {"second"} and output.num_scheduled_tokens == {"first": 1}
    assert_finished_cleanly(runner)


def test_priority_preemption_never_drops_a_request_already_scheduled_this_step() -> None:
    # "low" is admitted first and so runs ahead of "high" in the batch. Were "low" scheduled
    # (registering block 3 of its chunk 12..17 in the prefix cache) and then preempted for
    # "high", that block would stay cached without its K/V ever being computed.
    scheduler = make_scheduler(num_blocks=6, max_model_len=24, threshold=6, policy="priority")
    runner = make_runner(scheduler, make_request("low", tokens(1, 18), priority=5, max_tokens=2))
    assert schedule_of(runner) == [("low", 6)]
    scheduler.add_request(make_request("high", tokens(50, 4), arrival=1, priority=0,
                                       max_tokens=6))
    assert schedule_of(runner) == [("low", 6), ("high", 4)]
    output, _ = runner.step()  # high takes a 5th block; low needs two, one is left
    assert output.num_scheduled_tokens == {"high": 1}
    assert output.preempted_req_ids == {"low"}
    assert_finished_cleanly(runner)
    assert runner.streamed["low"] == [118, 119]


def test_prompt_logprobs_are_sent_once_across_preemptions() -> None:
    # b asks for prompt logprobs, so it gets no prefix hits: each resumption recomputes its
    # prompt from position 0, and the runner sends those rows again.
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, threshold=3)
    runner = make_runner(scheduler, make_request("a", tokens(1, 4), arrival=0, max_tokens=8),
                         make_request("b", tokens(50, 12), arrival=1, max_tokens=2,
                                      prompt_logprobs=0))
    runner.step()
    runner.step()
    output, _ = runner.step()
    assert output.preempted_req_ids == {"b"}  # in mid-prefill, six rows sent
    assert runner.streamed_prompt_logprobs["b"] == tokens(51, 6)
    assert_finished_cleanly(runner)
    assert scheduler.make_stats().num_preemptions >= 2
    assert runner.streamed_prompt_logprobs["b"] == tokens(51, 11)
    assert runner.streamed["b"] == [112, 113]


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, policy="priority")
    runner = make_runner(scheduler, make_request("a", tokens(1, 4), arrival=0, max_tokens=10),
                         make_request("b", tokens(50, 4), arrival=1, priority=1, max_tokens=10))
    runner.step()
    runner.step()  # a and b hold two blocks each
    scheduler.add_request(make_request("c", tokens(90, 2), arrival=2, max_tokens=1))
    for _ in range(3):
        assert not runner.step()[0].scheduled_new_reqs
    output, _ = runner.step()  # a needs a block: b goes, leaving one free block that c fits in
    assert output.preempted_req_ids == {"b"} and output.num_scheduled_tokens == {"a": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    output, _ = runner.step()
    assert [n.req_id for n in output.scheduled_new_reqs] == ["c"]
    assert_finished_cleanly(runner)


# ---------------------------------------------------------------------- stop conditions


def test_eos_stops_with_finish_reason_stop() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 3)),
                         token_fn=scripted({("a", 5): EOS}))
    for _ in range(3):
        runner.step()
    assert runner.streamed["a"] == [103, 104, EOS]
    assert runner.finish_reasons == {"a": "stop"} and runner.stop_reasons == {"a": None}
    assert_all_blocks_free(scheduler)
    output, _ = runner.step()
    assert output.finished_req_ids == {"a"}


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), ignore_eos=True, max_tokens=5),
                         token_fn=scripted({("a", 5): EOS}))
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [103, 104, EOS, 106, 107]
    assert runner.finish_reasons == {"a": "length"}


def test_stop_token_id_stops_with_it_as_stop_reason() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), stop_token_ids=[104]))
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [103, 104]
    assert runner.finish_reasons == {"a": "stop"} and runner.stop_reasons == {"a": 104}


def test_eos_listed_as_a_stop_token_under_ignore_eos_reports_it_as_stop_reason() -> None:
    scheduler = make_scheduler()
    runner = make_runner(
        scheduler, make_request("a", tokens(1, 3), ignore_eos=True, stop_token_ids=[EOS]),
        token_fn=scripted({("a", 4): EOS}))
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [103, EOS]
    assert runner.finish_reasons == {"a": "stop"} and runner.stop_reasons == {"a": EOS}


def test_max_tokens_stops_with_length() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), max_tokens=4))
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [103, 104, 105, 106]
    assert runner.finish_reasons == {"a": "length"} and runner.num_steps == 5


def test_min_tokens_suppresses_the_eos_stop_until_reached() -> None:
    scheduler = make_scheduler()
    eos_everywhere = scripted({("a", p): EOS for p in range(3, 10)})
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), min_tokens=3),
                         token_fn=eos_everywhere)
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [EOS, EOS, EOS]
    assert runner.finish_reasons == {"a": "stop"}


def test_min_tokens_also_holds_back_stop_token_ids() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), min_tokens=3,
                                                 stop_token_ids=[103, 105]))
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [103, 104, 105]
    assert runner.stop_reasons == {"a": 105}


def test_max_model_len_stops_with_length() -> None:
    scheduler = make_scheduler(max_model_len=12)
    runner = make_runner(scheduler, make_request("a", tokens(1, 10), max_tokens=None))
    assert_finished_cleanly(runner)
    assert runner.streamed["a"] == [110, 111]
    assert runner.finish_reasons == {"a": "length"}


def test_finished_request_frees_blocks_and_is_reported_once() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 6), max_tokens=1),
                         make_request("b", tokens(20, 6), max_tokens=3))
    runner.step()
    assert "a" not in scheduler.requests and scheduler.kv_cache_manager.get_block_ids("a") == ([],)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 3  # b's 2 blocks and the null block
    assert runner.step()[0].finished_req_ids == {"a"}
    assert runner.step()[0].finished_req_ids == set()
    assert_finished_cleanly(runner)


# ---------------------------------------------------------------------- aborts


def test_abort_running_request_frees_its_blocks_and_is_reported_next_step() -> None:
    scheduler = make_scheduler(threshold=4)
    runner = make_runner(scheduler, make_request("a", tokens(1, 10)),
                         make_request("b", tokens(50, 3)))
    assert schedule_of(runner) == [("a", 4), ("b", 3)]
    (aborted,) = scheduler.finish_requests(["a"])
    assert aborted.status == RequestStatus.FINISHED_ABORTED and aborted.finish_reason == "abort"
    assert "a" not in scheduler.requests and [r.request_id for r in scheduler.running] == ["b"]
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([],)
    scheduler.check_invariants()
    output, _ = runner.step()
    assert output.finished_req_ids == {"a"} and output.num_scheduled_tokens == {"b": 1}
    assert_finished_cleanly(runner)


def test_abort_waiting_request_removes_it_before_it_runs() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = make_runner(scheduler, make_request("a", tokens(1, 3)),
                         make_request("b", tokens(50, 3)))
    runner.step()
    assert [r.request_id for r in scheduler.finish_requests(["b"])] == ["b"]
    assert len(scheduler.waiting) == 0 and "b" not in scheduler.requests
    output, _ = runner.step()
    assert output.finished_req_ids == {"b"} and output.num_scheduled_tokens == {"a": 1}
    assert_finished_cleanly(runner)
    assert "b" not in runner.streamed


def test_abort_preempted_request_removes_it_from_waiting() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    runner = make_runner(scheduler, make_request("a", tokens(1, 4), arrival=0, max_tokens=4),
                         make_request("b", tokens(50, 7), arrival=1, max_tokens=3))
    for _ in range(3):
        output, _ = runner.step()
    assert output.preempted_req_ids == {"b"}
    (aborted,) = scheduler.finish_requests(["b"])
    assert aborted.status == RequestStatus.FINISHED_ABORTED and len(scheduler.waiting) == 0
    scheduler.check_invariants()
    assert runner.step()[0].finished_req_ids == {"b"}
    assert_finished_cleanly(runner)


def test_abort_ignores_unknown_finished_and_repeated_ids() -> None:
    scheduler = make_scheduler()
    runner = make_runner(scheduler, make_request("a", tokens(1, 3), max_tokens=1),
                         make_request("b", tokens(50, 3)))
    runner.step()  # a finishes
    assert [r.request_id for r in scheduler.finish_requests(["nope", "a", "b", "b"])] == ["b"]
    scheduler.check_invariants()
    assert runner.step()[0].finished_req_ids == {"a", "b"}
    assert_finished_cleanly(runner)


def test_adding_a_request_id_in_use_is_refused() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", tokens(1, 3)))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", tokens(1, 3)))


# ---------------------------------------------------------------------- admission order

ADMISSION = [("p2", 0.0, 2), ("p0-late", 2.0, 0), ("p0-early", 1.0, 0), ("p1", 0.5, 1)]


def admission_order(policy: str) -> list[str]:
    scheduler = make_scheduler(max_num_seqs=1, policy=policy)
    runner = make_runner(scheduler, *(make_request(r, tokens(10 * i + 1, 3), arrival=arrival,
                                                   priority=priority, max_tokens=1)
                                      for i, (r, arrival, priority) in enumerate(ADMISSION)))
    order = []
    while scheduler.has_unfinished_requests():
        output, _ = runner.step()
        order += [n.req_id for n in output.scheduled_new_reqs]
    assert_finished_cleanly(runner)
    return order


def test_priority_policy_admits_lowest_priority_value_then_earliest_arrival() -> None:
    assert admission_order("priority") == ["p0-early", "p0-late", "p1", "p2"]


def test_fcfs_policy_admits_in_order_of_adding() -> None:
    assert admission_order("fcfs") == ["p2", "p0-late", "p0-early", "p1"]


def test_has_unfinished_requests_and_stats_track_queues() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    assert not scheduler.has_unfinished_requests()
    runner = make_runner(scheduler, make_request("a", tokens(1, 5), max_tokens=2),
                         make_request("b", tokens(50, 3), max_tokens=2))
    assert scheduler.has_unfinished_requests()
    runner.step()
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 64)
    assert_finished_cleanly(runner)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


# ---------------------------------------------------------------------- async scheduling


def test_async_schedules_a_decode_before_its_previous_token_arrives() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    request = make_request("a", tokens(1, 6), max_tokens=5, ignore_eos=True)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt: it samples, so a token is now in flight
    assert first.num_scheduled_tokens == {"a": 6}
    assert request.num_output_placeholders == 1 and request.num_tokens == 6
    second = scheduler.schedule()  # scheduled again with nothing received yet
    assert second.num_scheduled_tokens == {"a": 1}
    assert request.num_computed_tokens == 7 and request.num_output_placeholders == 2
    scheduler.check_invariants()


def test_async_never_schedules_past_max_tokens_or_max_model_len() -> None:
    for params, max_model_len in (({"max_tokens": 3}, 64), ({"max_tokens": 50}, 10)):
        scheduler = make_scheduler(async_scheduling=True, max_model_len=max_model_len)
        runner = make_runner(scheduler, make_request("a", tokens(1, 7), ignore_eos=True,
                                                     **params))
        scheduled = []
        while scheduler.has_unfinished_requests():
            output, _ = runner.step()
            scheduled.append(output.num_scheduled_tokens.get("a", 0))
        assert runner.streamed["a"] == [100 + p for p in range(7, 10)]
        assert runner.finish_reasons["a"] == "length"
        # prompt, then one token per step, the last step waiting on the final token in flight
        assert scheduled == [7, 1, 1, 0]


def test_async_finished_request_drops_the_token_already_in_flight() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = make_runner(scheduler, make_request("a", tokens(1, 5)),
                         token_fn=scripted({("a", 6): EOS}))
    runner.run_until_done()
    assert runner.streamed["a"] == [105, EOS] and runner.finish_reasons["a"] == "stop"
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 1
    final, _ = runner.step()
    assert final.finished_req_ids == {"a"} and not runner.states


def test_async_preempted_request_resamples_the_token_it_had_in_flight() -> None:
    scheduler = make_scheduler(num_blocks=4, async_scheduling=True, max_model_len=16)
    runner = make_runner(scheduler, make_request("a", tokens(1, 7), max_tokens=8),
                         make_request("b", tokens(20, 7), max_tokens=8))
    runner.run_until_done()
    assert scheduler.num_preemptions > 0
    assert runner.streamed["a"] == [100 + p for p in range(7, 15)]
    assert runner.streamed["b"] == [100 + p for p in range(7, 15)]


def test_pipelined_batches_hold_different_requests_until_tokens_arrive() -> None:
    """Two batches in flight (two pipeline stages): a request whose token is still in flight
    sits out the next batch, so that batch N+1 never needs a token batch N has not produced."""
    scheduler = make_scheduler(budget=8, async_scheduling=True, max_batches_in_flight=2)
    for name, start in (("a", 1), ("b", 20)):
        scheduler.add_request(make_request(name, tokens(start, 8), max_tokens=4, ignore_eos=True))
    first = scheduler.schedule()  # the budget takes a's prompt only
    second = scheduler.schedule()  # a waits for its token: b's prompt goes alone
    third = scheduler.schedule()  # both wait
    assert first.num_scheduled_tokens == {"a": 8} and second.num_scheduled_tokens == {"b": 8}
    assert third.total_num_scheduled_tokens == 0
    scheduler.check_invariants()
