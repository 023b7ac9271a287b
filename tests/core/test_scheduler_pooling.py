"""Scheduler: pooling requests (the pooling runner's) are prefill only. Their prompt is chunked
and batched like any other; the step that computes its last token finishes the request with
the runner's vector and no token, under async scheduling too; MEAN / CLS pooling takes no
prefix-cache hit, LAST does. Driven through `FakeRunner`, which checks the invariants and the
K/V every step would read."""

from __future__ import annotations

import pytest
from helpers.fake_runner import FakeRunner

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int = 64, budget: int = 8, async_scheduling: bool = False
                   ) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
                        prefill=PrefillPolicy(), async_scheduling=async_scheduling),
        CacheConfig(block_size=BS, num_blocks=num_blocks + 1, enable_prefix_caching=True))


def pooling_request(req_id: str, prompt: list[int], pooling_type: str = "LAST") -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=1),
                   pooling_params=PoolingParams(pooling_type, True))


def run(scheduler: Scheduler, *requests: Request, runner: FakeRunner | None = None
        ) -> tuple[FakeRunner, dict[str, int]]:
    """Run to the end (on `runner`'s K/V, or a new one's); (the runner, tokens scheduled per
    request); `runner.pooled`: the vectors by request."""
    for request in requests:
        scheduler.add_request(request)
    runner = runner or FakeRunner(scheduler)
    scheduled: dict[str, int] = {}
    pooled: dict[str, object] = {}
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        output, outputs = runner.step()
        for req_id, n in output.num_scheduled_tokens.items():
            scheduled[req_id] = scheduled.get(req_id, 0) + n
        for out in outputs:
            if out.pooling_output is not None:
                assert out.new_token_ids == [] and out.finish_reason == "stop"
                pooled[out.req_id] = out.pooling_output
    runner.pooled = pooled
    return runner, scheduled


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pooling_requests_finish_after_their_prompt_with_the_vector_and_no_token(
        async_scheduling):
    scheduler = make_scheduler(budget=8, async_scheduling=async_scheduling)
    prompts = {"a": list(range(1, 21)), "b": list(range(30, 33)), "c": list(range(40, 51))}
    runner, scheduled = run(scheduler, *(pooling_request(k, p) for k, p in prompts.items()))
    # chunked over several steps (20 tokens at 8 a step), each prompt computed exactly once:
    # nothing is scheduled past it (no placeholder token under async scheduling)
    assert scheduled == {k: len(p) for k, p in prompts.items()}
    assert runner.pooled == {k: (0, len(p)) for k, p in prompts.items()}
    assert runner.streamed == {k: [] for k in prompts}
    assert scheduler.kv_cache_manager.num_free_blocks == 64  # every block back


@pytest.mark.parametrize("pooling_type, hit", [("LAST", True), ("MEAN", False), ("CLS", False)])
def test_only_last_token_pooling_takes_a_prefix_hit(pooling_type, hit):
    scheduler = make_scheduler()
    prompt = list(range(1, 14))
    runner, _ = run(scheduler, pooling_request("first", prompt))  # its full blocks: cached
    _, scheduled = run(scheduler, pooling_request("again", prompt, pooling_type), runner=runner)
    first_computed = runner.pooled["again"][0]
    assert (first_computed > 0) == hit and scheduled["again"] == len(prompt) - first_computed
    if hit:
        assert first_computed == 12  # three full blocks: the last token is always computed


def test_a_pooled_request_preempted_by_the_next_step_still_gets_its_vector():
    """Async scheduling: B (admitted first) decodes into a block only A holds; the next step's
    schedule preempts A, whose last chunk is in flight. A's vector is whole: it finishes from
    `waiting` when the step's output comes in, and is not computed again."""
    scheduler = make_scheduler(num_blocks=3, budget=16, async_scheduling=True)
    b = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    a = pooling_request("a", list(range(10, 18)))
    runner, scheduled = run(scheduler, b, a)
    assert runner.pooled == {"a": (0, 8)} and scheduled["a"] == 8
    assert runner.finish_reasons["b"] == "length" and scheduler.num_preemptions == 1
