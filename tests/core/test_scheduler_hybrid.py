"""The scheduler over hybrid KV caches, driven by `FakeRunner` (which rebuilds every group's
block table from the diffs and checks each group's reads: a sliding group's window only).

Block size 4; the fake model samples `100 + position`, never EOS.
"""

from __future__ import annotations

from helpers.fake_runner import FakeRunner, hybrid_cache_config
from helpers.requests import make_request

from aserve.config import SchedulerConfig
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler

BS = 4


def counting(req_id: str, position: int) -> int:
    return 100 + position


def make_scheduler(windows: list[int | None], num_blocks: int, *, budget: int = 64,
                   max_model_len: int = 64, async_scheduling: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                        max_model_len=max_model_len, async_scheduling=async_scheduling),
        hybrid_cache_config(windows, block_size=BS, num_blocks=num_blocks))


def start(scheduler: Scheduler, *requests: Request) -> FakeRunner:
    for request in requests:
        scheduler.add_request(request)
    return FakeRunner(scheduler, counting)


def finish(runner: FakeRunner) -> None:
    runner.run_until_done()
    kv = runner.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    last, _ = runner.step()
    assert last.is_empty and not runner.states


def test_new_and_cached_requests_carry_one_block_list_per_group() -> None:
    scheduler = make_scheduler([None, 6], num_blocks=64)
    runner = start(scheduler, make_request("a", list(range(20)), max_tokens=4))
    output, _ = runner.step()
    (new,) = output.scheduled_new_reqs
    assert new.block_ids == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    output, _ = runner.step()  # position 20 needs a 6th block in each group
    (cached,) = output.scheduled_cached_reqs
    assert cached.new_block_ids == ([11], [12])
    assert scheduler.kv_cache_manager.get_block_ids("a") == (
        [1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])  # 6, 7, 8 behind [15, 20]: freed
    output, _ = runner.step()
    assert output.scheduled_cached_reqs[0].new_block_ids == ([], [])
    finish(runner)


def test_prefix_hit_sends_null_blocks_for_the_skipped_sliding_slots() -> None:
    scheduler = make_scheduler([None, 6], num_blocks=64)
    runner = start(scheduler, make_request("a", list(range(20)), max_tokens=1))
    runner.step()
    scheduler.add_request(make_request("b", list(range(20)) + [99], max_tokens=3))
    output, _ = runner.step()
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 20 and output.num_scheduled_tokens == {"b": 1}
    assert new.block_ids[0][:5] == [1, 2, 3, 4, 5]
    assert new.block_ids[1][:5] == [0, 0, 0, 9, 10]
    assert scheduler.requests["b"].num_cached_tokens == 20
    finish(runner)
    assert runner.streamed["b"] == [121, 122, 123]


def test_same_prompt_several_times_shares_every_group() -> None:
    scheduler = make_scheduler([None, 5, None, 9], num_blocks=64)
    prompt = list(range(30))
    runner = start(scheduler, *[make_request(f"n{i}", prompt, max_tokens=6) for i in range(3)])
    runner.step()
    assert runner.streamed == {f"n{i}": [130] for i in range(3)}
    finish(runner)
    b = make_request("again", prompt, max_tokens=2)
    scheduler.add_request(b)
    output, _ = runner.step()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 28  # 7 full blocks, all groups
    finish(runner)


def test_all_sliding_model_serves_a_sequence_far_longer_than_the_cache() -> None:
    # W = 8, 10 usable blocks (40 tokens); one request of 10 + 150 tokens, budget 16.
    scheduler = make_scheduler([8, 8], num_blocks=11, budget=16, max_model_len=200)
    runner = start(scheduler, make_request("long", list(range(10)), max_tokens=150,
                                           ignore_eos=True))
    kv = scheduler.kv_cache_manager
    held = []
    while scheduler.has_unfinished_requests():
        runner.step()
        ids = kv.get_block_ids("long")
        if ids[0]:
            held.append(max(sum(i != 0 for i in group) for group in ids))
    assert scheduler.num_preemptions == 0
    assert runner.streamed["long"] == [100 + p for p in range(10, 160)]
    assert len(held) == 149 and max(held) <= 4  # ceil(7 / 4) + 1 per group (the last step frees)
    finish(runner)


def test_hybrid_preemption_resumes_from_every_groups_cached_prefix() -> None:
    # 8 usable blocks; each request needs 2 per 4 tokens (full + sliding, W = 5).
    scheduler = make_scheduler([None, 5], num_blocks=9, max_model_len=32)
    runner = start(scheduler, make_request("a", list(range(8)), max_tokens=8),
                   make_request("b", list(range(50, 58)), max_tokens=8))
    for _ in range(12):
        runner.step()
    assert scheduler.num_preemptions >= 1
    finish(runner)
    assert runner.streamed["a"] == [100 + p for p in range(8, 16)]
    assert runner.streamed["b"] == [100 + p for p in range(8, 16)]


def test_async_scheduling_with_a_sliding_window() -> None:
    scheduler = make_scheduler([None, 3], num_blocks=32, async_scheduling=True)
    runner = start(scheduler, make_request("a", list(range(9)), max_tokens=12),
                   make_request("b", list(range(9)) + [7], max_tokens=5))
    finish(runner)
    assert runner.streamed["a"] == [100 + p for p in range(9, 21)]
    assert runner.streamed["b"] == [100 + p for p in range(10, 15)]
