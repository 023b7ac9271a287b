"""Random workloads under memory pressure: the scheduler always drains, and recompute is exact.

Hypothesis draws a configuration (policy, block size, the model's attention layout: all full,
full + sliding, full + two windows, or all sliding, with windows that may be 1, below, above or
not a multiple of the block size; a cache a few blocks above what one request of
`max_model_len` holds at once, token budget, `max_num_seqs`, chunk threshold, prefix caching
and async scheduling on or off) and a workload (arrivals over time, prompts sharing prefixes so
the cache hits, max/min tokens, ignore_eos, stop tokens, priorities, salts, aborts).
`FakeRunner` checks every step: invariants (per KV cache group), budget and sequence limits,
block coverage, and the K/V each request would attend to (in a sliding group: its window only).

At the end every request has finished, every block is free, and each request streamed exactly
the tokens it streams when run alone (and that an oracle of the stop rules predicts), and its
prompt logprobs once each: the fake model samples `fake_token(req_id, position)`, so
preemption and recompute must not change a single token.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from helpers.fake_runner import FakeRunner, fake_token, hybrid_cache_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig
from aserve.core.kv_cache_utils import blocks_per_request
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams

VOCAB = 12  # small, so EOS (0) and stop tokens come up often
EOS = 0
MAX_STEPS = 3000


def model(req_id: str, position: int) -> int:
    return fake_token(req_id, position, VOCAB)


@dataclass(frozen=True)
class Spec:
    req_id: str
    prompt: tuple[int, ...]
    arrival_step: int
    priority: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    cache_salt: str | None
    abort_step: int | None
    prompt_logprobs: int | None = None

    def make_request(self) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, min_tokens=self.min_tokens,
                                ignore_eos=self.ignore_eos,
                                stop_token_ids=list(self.stop_token_ids),
                                prompt_logprobs=self.prompt_logprobs)
        return Request(self.req_id, list(self.prompt), params,
                       arrival_time=float(self.arrival_step), priority=self.priority,
                       cache_salt=self.cache_salt, eos_token_ids=(EOS,))


@dataclass(frozen=True)
class Scenario:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    specs: tuple[Spec, ...]
    token_fn: Callable[[str, int], int] = model  # the fake model


def expected_output(spec: Spec, max_model_len: int,
                    token_fn: Callable[[str, int], int] = model) -> tuple[list[int], str]:
    """The oracle: the tokens and finish reason the stop rules of DESIGN.md §3 give."""
    stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else {EOS})
    max_tokens = spec.max_tokens or 1 << 62
    out: list[int] = []
    while True:
        out.append(token_fn(spec.req_id, len(spec.prompt) + len(out)))
        if len(out) >= max_tokens or len(spec.prompt) + len(out) >= max_model_len:
            return out, "length"
        if len(out) >= spec.min_tokens and out[-1] in stop_ids:
            return out, "stop"


def draw_layer_windows(draw: st.DrawFn, kinds: list[str]) -> list[int | None]:
    """A model's per-layer windows (None: full attention), of one of `kinds`."""
    window = st.integers(1, 9)
    kind = draw(st.sampled_from(kinds))
    if kind == "full":
        return [None]
    if kind == "hybrid":
        return [None, draw(window)]
    if kind == "hybrid2":
        return [None, draw(window), None, draw(window)]
    return [draw(window)] * draw(st.integers(1, 2))  # all sliding


@st.composite
def scenarios(draw: st.DrawFn, kinds: tuple[str, ...] = ("full", "hybrid", "hybrid2",
                                                          "sliding")) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 24))
    budget = draw(st.integers(1, 20))
    layer_windows = draw_layer_windows(draw, list(kinds))
    probe = hybrid_cache_config(layer_windows, block_size=block_size, num_blocks=2)
    # One request of max_model_len always fits alone, beside the null block.
    num_blocks = (blocks_per_request(probe.groups, max_model_len, budget) + 1
                  + draw(st.integers(0, 3)))
    scheduler_config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        prefill=PrefillPolicy(long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 5]))),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        async_scheduling=draw(st.booleans()),
    )
    cache_config = hybrid_cache_config(
        layer_windows, block_size=block_size, num_blocks=num_blocks,
        enable_prefix_caching=draw(st.sampled_from([True, True, False])))
    token = st.integers(0, VOCAB - 1)
    prefixes = [draw(st.lists(token, max_size=max_model_len)) for _ in range(2)]
    specs = []
    for i in range(draw(st.integers(1, 8))):
        prefix = prefixes[draw(st.integers(0, 1))][:draw(st.integers(0, max_model_len))]
        prompt = (prefix + draw(st.lists(token, max_size=6)))[:max_model_len - 1] or [1]
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 10)))
        specs.append(Spec(
            req_id=f"r{i}",
            prompt=tuple(prompt),
            arrival_step=draw(st.integers(0, 8)),
            priority=draw(st.integers(0, 2)),
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens or 4)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=tuple(draw(st.lists(token, max_size=2))),
            cache_salt=draw(st.sampled_from([None, None, "salt"])),
            abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 20))),
            prompt_logprobs=draw(st.sampled_from([None, None, None, 0, 2])),
        ))
    return Scenario(scheduler_config, cache_config, tuple(specs))


def run(scenario: Scenario, specs: tuple[Spec, ...]) -> tuple[FakeRunner, set[str]]:
    """Drive `specs` to the end; return the runner and the ids actually aborted."""
    scheduler = Scheduler(scenario.scheduler_config, scenario.cache_config)
    runner = FakeRunner(scheduler, scenario.token_fn)
    aborted: set[str] = set()
    last_event = max(max(s.arrival_step, s.abort_step or 0) for s in specs)
    for step in range(MAX_STEPS):
        for spec in specs:
            if spec.arrival_step == step:
                scheduler.add_request(spec.make_request())
            if spec.abort_step == step:
                aborted.update(r.request_id for r in scheduler.finish_requests([spec.req_id]))
        scheduler.check_invariants()
        if step > last_event and not scheduler.has_unfinished_requests():
            break
        runner.step()
    else:
        raise AssertionError(f"not drained after {MAX_STEPS} steps: {scheduler.requests}")
    pool = scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks - 1 and not scheduler.requests
    final, _ = runner.step()
    assert final.is_empty and not runner.states  # the runner was told to drop every request
    return runner, aborted


def check_scenario(scenario: Scenario) -> Scheduler:
    """Run the scenario; compare with each request run alone and with the oracle. Returns the
    scheduler that ran it (for its counters)."""
    runner, aborted = run(scenario, scenario.specs)
    max_model_len = scenario.scheduler_config.max_model_len
    alone = Scenario(scenario.scheduler_config, scenario.cache_config, (), scenario.token_fn)
    for spec in scenario.specs:
        solo_spec = Spec(**{**spec.__dict__, "arrival_step": 0, "abort_step": None})
        solo, _ = run(alone, (solo_spec,))
        expected_tokens, expected_reason = expected_output(spec, max_model_len,
                                                           scenario.token_fn)
        assert solo.streamed[spec.req_id] == expected_tokens
        assert solo.finish_reasons[spec.req_id] == expected_reason
        streamed = runner.streamed.get(spec.req_id, [])
        prompt_rows = runner.streamed_prompt_logprobs.get(spec.req_id, [])
        if spec.prompt_logprobs is None:
            assert not prompt_rows
        elif spec.req_id not in aborted:
            assert prompt_rows == list(spec.prompt[1:]), "prompt logprobs lost or repeated"
        else:
            assert prompt_rows == list(spec.prompt[1:1 + len(prompt_rows)])
        if spec.req_id in aborted:
            assert streamed == expected_tokens[:len(streamed)]
            assert spec.req_id not in runner.finish_reasons
        else:
            assert streamed == expected_tokens, f"{spec.req_id} changed under pressure"
            assert runner.finish_reasons[spec.req_id] == expected_reason
    return runner.scheduler


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_drain_and_match_running_alone(scenario: Scenario) -> None:
    check_scenario(scenario)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(kinds=("hybrid", "hybrid2")))
def test_hybrid_workloads_drain_and_match_running_alone(scenario: Scenario) -> None:
    """Full attention beside one or two sliding windows: every group's hit, skip and
    preemption stays consistent with the others."""
    assert {g.kind for g in scenario.cache_config.groups} == {"full", "sliding"}
    check_scenario(scenario)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(kinds=("sliding",)))
def test_all_sliding_workloads_drain_and_match_running_alone(scenario: Scenario) -> None:
    check_scenario(scenario)


def inverted_priority_workload(rng: random.Random, trial: int, policy: str,
                               async_scheduling: bool) -> Scenario:
    """A long, least urgent prompt arrives first and is prefilled in small chunks; short, more
    urgent requests sharing its prefix arrive next and decode beside it in a nearly full cache."""
    block_size, max_model_len = rng.choice([1, 2, 4]), 24
    shared = [rng.randrange(1, VOCAB) for _ in range(20)]
    specs = [Spec(f"t{trial}-long", tuple(shared[:rng.randrange(12, 20)]), 0, 9,
                  rng.randrange(2, 5), 0, True, (), None, None)]
    for i in range(4):
        prompt = shared[:rng.randrange(0, 8)] + [rng.randrange(VOCAB)
                                                 for _ in range(rng.randrange(1, 4))]
        specs.append(Spec(f"t{trial}-{i}", tuple(prompt), rng.randrange(1, 4), rng.randrange(3),
                          rng.randrange(4, 12), 0, True, (), None, None))
    return Scenario(
        SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=16, max_model_len=max_model_len,
                        prefill=PrefillPolicy(long_prefill_token_threshold=3), policy=policy,
                        async_scheduling=async_scheduling),
        CacheConfig(block_size=block_size,
                    num_blocks=max_model_len // block_size + 1 + rng.choice([0, 1, 2])),
        tuple(specs))


def test_seeded_inverted_priority_workloads_preempt_and_still_match() -> None:
    """Fixed workloads that preempt on every run, often a less urgent request in mid-prefill."""
    rng = random.Random(0)
    num_preemptions = 0
    for trial in range(40):
        policy = ("priority", "fcfs")[trial % 4 == 3]
        num_preemptions += check_scenario(inverted_priority_workload(
            rng, trial, policy, async_scheduling=trial % 2 == 1)).num_preemptions
    assert num_preemptions >= 40


def shared_prefix_hybrid_workload(rng: random.Random, trial: int) -> Scenario:
    """Requests sharing long prefixes arrive one after another on a hybrid (or all-sliding)
    model in a tight cache: later ones hit earlier ones' blocks in every group, some of them
    freed behind the window, while preemptions free and re-hit them."""
    block_size, max_model_len = rng.choice([1, 2, 4]), 24
    windows = rng.choice([[None, rng.randrange(1, 10)],
                          [None, rng.randrange(1, 6), None, rng.randrange(4, 12)],
                          [rng.randrange(1, 10)]])
    budget = rng.randrange(4, 17)
    shared = [rng.randrange(1, VOCAB) for _ in range(20)]
    specs = []
    for i in range(5):
        prompt = shared[:rng.randrange(6, 20)] + [rng.randrange(VOCAB)
                                                  for _ in range(rng.randrange(0, 3))]
        specs.append(Spec(f"h{trial}-{i}", tuple(prompt), 2 * i + rng.randrange(2),
                          rng.randrange(3), rng.randrange(2, 8), 0, True, (), None,
                          rng.choice([None, None, None, 12])))
    probe = hybrid_cache_config(windows, block_size=block_size, num_blocks=2)
    num_blocks = blocks_per_request(probe.groups, max_model_len, budget) + 1 + rng.randrange(3)
    return Scenario(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                        max_model_len=max_model_len, prefill=PrefillPolicy(
                            long_prefill_token_threshold=rng.choice([0, 3, 5])),
                        policy=rng.choice(["fcfs", "priority"]),
                        async_scheduling=trial % 2 == 1),
        hybrid_cache_config(windows, block_size=block_size, num_blocks=num_blocks),
        tuple(specs))


def test_seeded_shared_prefix_hybrid_workloads_hit_preempt_and_still_match() -> None:
    rng = random.Random(1)
    num_preemptions = num_hits = 0
    for trial in range(40):
        scheduler = check_scenario(shared_prefix_hybrid_workload(rng, trial))
        num_preemptions += scheduler.num_preemptions
        num_hits += scheduler.kv_cache_manager.prefix_cache_hits
    assert num_preemptions >= 20 and num_hits >= 500
