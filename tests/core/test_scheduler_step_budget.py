"""The prefill budget: a step that carries decodes takes at most the prefill tokens that cost
`max_prefill_step_ratio` times a step's fixed cost, by the step cost model; a step without
decodes, or with at most `prefill_first_streams` streams decoding, keeps the whole token
budget. Driven through `FakeRunner` (which checks the K/V every request reads), with a stub
cost model where a test fixes the cap, and the real one fed by a synthetic step duration
where it learns it."""

from __future__ import annotations

from helpers.fake_runner import FakeRunner
from helpers.requests import make_request

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig
from aserve.core.scheduler import Scheduler

BS = 4


class FixedCap:
    """A cost model that allows `cap` prefill tokens beside any decodes, and `mixed` where a
    mixed step is held to a ratio of its decodes; records what it is fed."""

    def __init__(self, cap: int | None, mixed: int | None = None,
                 key_cost: float = 0.0) -> None:
        self.cap, self.mixed, self.key_cost = cap, mixed, key_cost
        self.recorded: list[tuple[int, float]] = []
        self.keys: list[int] = []
        self.asked: list[float] = []
        self.asked_mixed: list[tuple[float, int]] = []
        self.is_timed = True

    def record(self, num_tokens: int, seconds: float, num_keys: int = 0) -> None:
        self.recorded.append((num_tokens, seconds))
        self.keys.append(num_keys)

    def key_cost_tokens(self) -> float:
        return self.key_cost

    def max_prefill_tokens(self, ratio: float) -> int | None:
        self.asked.append(ratio)
        return self.cap

    def mixed_step_tokens(self, ratio: float, num_decodes: int) -> int | None:
        self.asked_mixed.append((ratio, num_decodes))
        return self.mixed


def make_scheduler(*, ratio: float = 2.0, budget: int = 64, async_scheduling: bool = False,
                   cost=None, cap_decodes: int = 0, mixed: float = 2.0,
                   first_streams: int = 0) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=128,
                        async_scheduling=async_scheduling,
                        prefill=PrefillPolicy(max_prefill_step_ratio=ratio,
                                              prefill_cap_decodes=cap_decodes,
                                              max_mixed_step_ratio=mixed,
                                              prefill_first_streams=first_streams)),
        CacheConfig(block_size=BS, num_blocks=129))
    if cost is not None:
        scheduler.step_cost = cost
    return scheduler


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run(scheduler: Scheduler, *requests, **runner_kwargs) -> FakeRunner:
    for request in requests:
        scheduler.add_request(request)
    return FakeRunner(scheduler, lambda req_id, position: 100 + position, **runner_kwargs)


def schedule_of(runner: FakeRunner) -> dict[str, int]:
    output, _ = runner.step()
    return dict(output.num_scheduled_tokens)


def test_prefill_beside_decodes_is_capped_and_the_decodes_all_run() -> None:
    cost = FixedCap(10)
    scheduler = make_scheduler(cost=cost)
    runner = run(scheduler, make_request("a", prompt(1, 8), max_tokens=8),
                 make_request("b", prompt(20, 8), max_tokens=8))
    assert schedule_of(runner) == {"a": 8, "b": 8}  # no decodes yet: the whole budget
    scheduler.add_request(make_request("c", prompt(40, 30), max_tokens=4))
    scheduler.add_request(make_request("d", prompt(80, 30), max_tokens=4))
    assert schedule_of(runner) == {"a": 1, "b": 1, "c": 10}  # d waits for a later step
    assert schedule_of(runner) == {"a": 1, "b": 1, "c": 10}
    assert schedule_of(runner) == {"a": 1, "b": 1, "c": 10}
    assert schedule_of(runner) == {"a": 1, "b": 1, "c": 1, "d": 10}  # c now decodes
    assert cost.asked[-1] == 2.0
    runner.run_until_done()
    for req_id, n in (("a", 8), ("b", 8), ("c", 30), ("d", 30)):
        assert runner.streamed[req_id] == [100 + n + i for i in range(8 if n == 8 else 4)]


def test_more_streams_than_prefill_cap_decodes_scale_the_ratio_down() -> None:
    cost = FixedCap(10)
    scheduler = make_scheduler(cost=cost, cap_decodes=2)
    runner = run(scheduler, *(make_request(f"r{i}", prompt(10 * i + 1, 4), max_tokens=20)
                              for i in range(2)))
    schedule_of(runner)  # both prompts: no decodes yet
    scheduler.add_request(make_request("late", prompt(50, 30), max_tokens=20))
    schedule_of(runner)  # 2 streams decoding: not more than 2, the ratio as given
    assert cost.asked[-1] == 2.0
    for i in range(2, 4):
        scheduler.add_request(make_request(f"r{i}", prompt(100 + 10 * i, 4), max_tokens=20))
    def decoding() -> int:
        return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)

    while decoding() < 4:
        schedule_of(runner)
    streams = decoding()
    # (the cap is worked out for a step that has prefill to carry: one of decodes alone
    # never asks)
    asked = len(cost.asked)
    schedule_of(runner)
    assert len(cost.asked) == asked
    scheduler.add_request(make_request("last", prompt(300, 30), max_tokens=2))
    schedule_of(runner)
    assert cost.asked[-1] == 2.0 * 2 / streams
    runner.run_until_done()
    assert runner.streamed["late"] == [100 + 30 + i for i in range(20)]


def decode_streams(scheduler: Scheduler, runner: FakeRunner, n: int) -> None:
    """n requests of one block of prompt, all decoding once this returns."""
    for i in range(n):
        scheduler.add_request(make_request(f"s{i}", prompt(1 + 10 * i, BS), max_tokens=30))
    schedule_of(runner)  # every prompt in one step: nothing decodes yet


def test_a_mixed_step_is_held_to_its_ratio_of_the_decodes() -> None:
    for streams in (3, 10):  # 30 tokens over 6 or 20 steps: under the target
        cost = FixedCap(40, mixed=12)
        scheduler = make_scheduler(cost=cost, mixed=2.5)
        runner = run(scheduler)
        decode_streams(scheduler, runner, streams)
        scheduler.add_request(make_request("late", prompt(200, 30), max_tokens=3))
        step = schedule_of(runner)
        assert step.pop("late") == 12  # the mixed-step cap, not the fixed-cost one (40)
        assert step == {f"s{i}": 1 for i in range(streams)}
        assert cost.asked_mixed[-1] == (2.5, streams)
        runner.run_until_done()
        assert runner.streamed["late"] == [100 + 30 + i for i in range(3)]


def drain_steps(streams: int) -> int:
    return min(PrefillPolicy.DRAIN_STEPS_PER_DECODE * streams, PrefillPolicy.PREFILL_DRAIN_STEPS)


def test_prompts_pending_raise_the_mixed_step_cap_to_drain_them() -> None:
    # 24 x 30 prompt tokens pending: over 2 steps a stream (or 32), more than the target (12)
    for streams, drained in ((10, 36), (20, 22)):
        scheduler = make_scheduler(cost=FixedCap(40, mixed=12), budget=128)
        runner = run(scheduler)
        decode_streams(scheduler, runner, streams)
        for i in range(24):
            scheduler.add_request(make_request(f"w{i}", prompt(300 + 40 * i, 30), max_tokens=2))
        step = schedule_of(runner)
        prefill = sum(n for req_id, n in step.items() if req_id.startswith("w"))
        assert prefill == 24 * 30 // drain_steps(streams) == drained


def test_a_prompt_drains_at_one_rate_and_ends_within_the_drain_steps() -> None:
    # 3 streams: 6 drain steps; a 96-token prompt goes 16 a step (target 4), all 6 steps,
    # instead of a sixth of its rest each step (16, 13, 11, 9, ... never done in 6)
    scheduler = make_scheduler(cost=FixedCap(40, mixed=4), budget=128)
    runner = run(scheduler)
    decode_streams(scheduler, runner, 3)
    scheduler.add_request(make_request("late", prompt(300, 96), max_tokens=2))
    chunks = [schedule_of(runner)["late"] for _ in range(drain_steps(3))]
    assert chunks == [96 // drain_steps(3)] * drain_steps(3)
    runner.run_until_done()
    assert runner.streamed["late"] == [100 + 96 + i for i in range(2)]


def first_chunk_of_late(scheduler: Scheduler, shared: list[int], new: list[int],
                        cached: bool) -> int:
    """Beside 2 decoding streams, the tokens the first step gives a request of `shared` +
    `new` prompt tokens (`shared` left in the prefix cache by a finished request where
    `cached`); the request then runs to its end with the right tokens."""
    runner = run(scheduler)
    if cached:  # a finished request leaves the shared tokens' blocks in the prefix cache
        scheduler.add_request(make_request("first", shared + [1], max_tokens=1))
        runner.run_until_done()
    decode_streams(scheduler, runner, 2)
    scheduler.add_request(make_request("late", shared + new, max_tokens=2))
    chunk = schedule_of(runner)["late"]
    runner.run_until_done()
    assert runner.streamed["late"] == [100 + len(shared) + len(new) + i for i in range(2)]
    return chunk


def test_a_cached_prefix_is_not_pending() -> None:
    shared = prompt(500, 48)
    for cached, expected in ((False, 60 // drain_steps(2)), (True, 12)):
        scheduler = make_scheduler(cost=FixedCap(40, mixed=12))
        # pending: the 60 tokens over 4 steps (15), or the 12 past the cached 48 (target 12)
        assert first_chunk_of_late(scheduler, shared, prompt(700, 12), cached) == expected


def test_a_long_prompt_among_few_streams_or_a_ratio_of_0_keep_the_fixed_cost_cap() -> None:
    for streams, mixed, length in ((1, 2.0, 100), (10, 0, 60)):
        cost = FixedCap(40, mixed=12)
        scheduler = make_scheduler(cost=cost, mixed=mixed)
        runner = run(scheduler)
        decode_streams(scheduler, runner, streams)
        scheduler.add_request(make_request("late", prompt(200, length), max_tokens=3))
        assert schedule_of(runner)["late"] == 40  # 100 over 2 steps: above the fixed cap
        assert (cost.asked_mixed == []) == (mixed == 0)


def test_up_to_prefill_first_streams_decoding_prefill_has_the_whole_budget() -> None:
    # budget 64: with N streams or fewer decoding, a prompt's chunk is what the decodes leave;
    # with more (or N = 0), the caps as before: the fixed-cost one (40), lowered by the
    # mixed-step one (target 12) to the 100 tokens' drain rate over 2 steps a stream
    for first, streams, expected in ((3, 1, 63), (3, 3, 61), (3, 4, 100 // drain_steps(4)),
                                     (0, 1, 40), (1, 2, 100 // drain_steps(2))):
        cost = FixedCap(40, mixed=12)
        scheduler = make_scheduler(cost=cost, first_streams=first)
        runner = run(scheduler)
        decode_streams(scheduler, runner, streams)
        scheduler.add_request(make_request("late", prompt(200, 100), max_tokens=3))
        step = schedule_of(runner)
        assert step.pop("late") == expected, (first, streams)
        assert step == {f"s{i}": 1 for i in range(streams)}  # the decodes all run
        assert (cost.asked == []) == (streams <= first)  # the cost model is not consulted
        runner.run_until_done()
        assert runner.streamed["late"] == [100 + 100 + i for i in range(3)]


def test_prefill_first_streams_must_not_be_negative() -> None:
    import pytest

    with pytest.raises(ValueError, match="prefill_first_streams"):
        PrefillPolicy(prefill_first_streams=-1)


def test_max_mixed_step_ratio_is_above_1_or_0() -> None:
    import pytest

    for bad in (1.0, 0.5, -2):
        with pytest.raises(ValueError, match="max_mixed_step_ratio"):
            PrefillPolicy(max_mixed_step_ratio=bad)
    assert PrefillPolicy(max_mixed_step_ratio=0).max_mixed_step_ratio == 0


def test_prefill_cap_decodes_must_not_be_negative() -> None:
    import pytest

    with pytest.raises(ValueError, match="prefill_cap_decodes"):
        PrefillPolicy(prefill_cap_decodes=-1)


def test_the_cap_is_never_under_one_block() -> None:
    scheduler = make_scheduler(cost=FixedCap(1))
    runner = run(scheduler, make_request("a", prompt(1, 4), max_tokens=4))
    schedule_of(runner)
    scheduler.add_request(make_request("b", prompt(20, 12), max_tokens=2))
    assert schedule_of(runner) == {"a": 1, "b": BS}


def test_without_a_ratio_prefill_has_the_whole_budget() -> None:
    scheduler = make_scheduler(ratio=0, cost=FixedCap(10))
    runner = run(scheduler, make_request("a", prompt(1, 4), max_tokens=4))
    schedule_of(runner)
    scheduler.add_request(make_request("b", prompt(20, 40), max_tokens=2))
    assert schedule_of(runner) == {"a": 1, "b": 40}


def test_a_runner_that_reports_no_step_times_gets_no_cap() -> None:
    scheduler = make_scheduler()
    runner = run(scheduler, make_request("a", prompt(1, 4), max_tokens=4))
    schedule_of(runner)  # the fake runner's steps take no time
    scheduler.add_request(make_request("b", prompt(20, 60), max_tokens=2))
    assert not scheduler.step_cost.is_timed
    assert schedule_of(runner) == {"a": 1, "b": 60}


def test_while_the_cost_is_unknown_prefill_beside_decodes_has_half_the_budget() -> None:
    scheduler = make_scheduler(cost=FixedCap(None))
    runner = run(scheduler, make_request("a", prompt(1, 4), max_tokens=4))
    schedule_of(runner)
    scheduler.add_request(make_request("b", prompt(20, 60), max_tokens=2))
    assert schedule_of(runner) == {"a": 1, "b": 32}


def test_the_scheduler_feeds_its_cost_model_each_step_composition() -> None:
    cost = FixedCap(None)
    scheduler = make_scheduler(cost=cost)
    runner = run(scheduler, make_request("a", prompt(1, 6), max_tokens=3),
                 step_seconds=lambda p, d: 0.5 + p + 10 * d)
    runner.run_until_done()
    assert cost.recorded == [(6, 6.5), (1, 10.5), (1, 10.5)]
    assert cost.keys == [6 * 7 // 2, 7, 8]  # the prompt's rows read 1..6 keys, decodes 7, 8


def test_a_chunk_after_a_cached_prefix_pays_for_its_keys() -> None:
    """The prefill cap is in tokens of the fit: a chunk's keys cost `key_cost_tokens` each
    (`step_cost.chunk_cost`), so the same cap buys fewer tokens after a cached prefix."""
    from aserve.core.step_cost import tokens_within

    key_cost, got = 0.05, {}
    for cached in (False, True):
        scheduler = make_scheduler(cost=FixedCap(40, key_cost=key_cost), mixed=0)
        got[cached] = first_chunk_of_late(scheduler, prompt(500, 48), prompt(700, 30), cached)
    assert got == {False: tokens_within(40, 0, key_cost), True: tokens_within(40, 48, key_cost)}
    assert got[True] < got[False] < 40  # 10 and 24 tokens


def step_seconds(num_prefill: int, num_decode: int) -> float:
    return 0.020 + 0.001 * (num_prefill + num_decode)  # a fixed cost of 20 tokens


def run_staggered(ratio: float, async_scheduling: bool) -> tuple[list[int], FakeRunner]:
    """Six requests arriving over the first steps; every mixed step's prefill tokens."""
    requests = [make_request(f"r{i}", prompt(1 + 50 * i, 9 + 7 * i), max_tokens=12)
                for i in range(6)]
    scheduler = make_scheduler(ratio=ratio, async_scheduling=async_scheduling, budget=48)
    runner = run(scheduler, *requests[:2], step_seconds=step_seconds)
    arrivals = {3: requests[2], 5: requests[3], 6: requests[4], 9: requests[5]}
    mixed = []
    for step in range(200):
        if step in arrivals:
            scheduler.add_request(arrivals[step])
        if step > 9 and not scheduler.has_unfinished_requests():
            break
        output, _ = runner.step()
        num_decode = output.num_decode_tokens
        if num_decode and output.total_num_scheduled_tokens > num_decode:
            mixed.append(output.total_num_scheduled_tokens - num_decode)
    return mixed, runner


def test_a_learnt_cost_bounds_every_mixed_step_and_outputs_are_unchanged() -> None:
    for async_scheduling in (False, True):
        uncapped, free_runner = run_staggered(0, async_scheduling)
        capped, runner = run_staggered(1.0, async_scheduling)  # one fixed cost: 20 tokens
        assert max(uncapped) > 30
        assert capped[0] <= 48 // 2  # half the budget while the fit cannot tell
        assert max(capped[1:]) <= 21  # then what one fixed cost buys, learnt as it goes
        assert runner.streamed == free_runner.streamed
        assert set(runner.streamed) == {f"r{i}" for i in range(6)}
        for i in range(6):
            assert runner.streamed[f"r{i}"] == [100 + 9 + 7 * i + k for k in range(12)]
