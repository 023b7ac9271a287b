"""Random scheduler workloads for the property tests (tests/core/test_scheduler_property.py,
test_scheduler_speculative.py): `scenarios` draws a configuration and a workload with
Hypothesis, `check_scenario` drives it with `FakeRunner` and compares every request's stream
with the same request run alone and with the oracle of the stop rules (`expected_output`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig
from aserve.core.kv_cache_utils import blocks_per_request
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams
from helpers.fake_runner import FakeRunner, fake_token, hybrid_cache_config

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


def repeating(req_id: str, position: int) -> int:
    """A model whose output cycles with a period of 2-5 tokens, one token in five off it:
    drafts of the request's own tokens are accepted and rejected both."""
    if fake_token(req_id, position + 10_000, 5) == 0:
        return fake_token(req_id, position, VOCAB)
    return fake_token(req_id, position % (2 + fake_token(req_id, -1, 4)), VOCAB)
