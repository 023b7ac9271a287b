"""Decode graphs: padding to the captured sizes and the static buffers give the same tokens as
eager steps. On CPU a fake platform "captures" by remembering the function and "replays" by
rerunning it into the captured output tensor, so everything but the CUDA capture itself — buffer
filling, padding rows that write no K/V, slicing the output — runs here. The real capture runs
in scripts/gpu_check.sh."""

from __future__ import annotations

import random

import pytest

from aserve import LLM, SamplingParams
from aserve.backends import CpuPlatform
from aserve.runner import worker as worker_module
from aserve.runner.graphs import default_capture_sizes


class FakeGraphPlatform(CpuPlatform):
    supports_graphs = True

    def __init__(self) -> None:
        super().__init__()
        self.captured: list[int] = []

    def graph_pool(self):
        return object()

    def capture_graph(self, fn, pool):
        out = fn()
        self.captured.append(out.shape[0])
        return (lambda: out.copy_(fn())), out


def test_capture_sizes_cover_one_to_max_num_seqs():
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(1000)[-3:] == [240, 248, 256]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_replayed_decode_steps_match_eager_steps(model_dir_factory, monkeypatch, arch):
    model_dir = model_dir_factory(arch)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]}
               for n in (3, 17, 9, 40, 5)]
    # different lengths: the decode batch shrinks 5 -> 1, replayed as 8, 4, 4, 2, 1
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (6, 12, 20, 9, 15)]
    eager = LLM(model_dir, dtype="float32", max_num_seqs=8, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]

    platform = FakeGraphPlatform()
    monkeypatch.setattr(worker_module, "set_platform", lambda device: platform)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=8, block_size=4)
    assert platform.captured == [8, 4, 2, 1]
    graphs = llm.engine_core.executor.worker.runner.graphs
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert graphs.num_replays >= 15
    # again, now with prefix-cache hits and a different mix
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_enforce_eager_captures_nothing(model_dir_factory, monkeypatch):
    platform = FakeGraphPlatform()
    monkeypatch.setattr(worker_module, "set_platform", lambda device: platform)
    llm = LLM(model_dir_factory("llama"), dtype="float32", max_num_seqs=4, enforce_eager=True)
    assert platform.captured == [] and llm.engine_core.executor.worker.runner.graphs is None


class StaticShapePlatform(CpuPlatform):
    static_shapes = True


def test_static_shape_platforms_see_power_of_two_token_counts_and_same_tokens(
        model_dir_factory, monkeypatch):
    """XLA's strategy, on CPU: every forward's token count is a power of two (>= 16), padding
    rows write no K/V, and greedy tokens are unchanged."""
    model_dir = model_dir_factory("llama")
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]}
               for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(model_dir, dtype="float32").generate(prompts, params)]
    monkeypatch.setattr(worker_module, "set_platform", lambda device: StaticShapePlatform())
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=24, block_size=4)
    seen = []
    embed = llm.engine_core.executor.worker.runner.model.model.embed_tokens
    embed.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert seen and all(n >= 16 and n & (n - 1) == 0 for n in seen)
    assert set(seen) <= {16, 32}


def test_verification_steps_replay_graphs_of_their_own(model_dir_factory, monkeypatch):
    """With k drafts, steps where every request has 1 + k rows replay graphs captured for that
    (padding requests of 1 + k rows write no K/V): greedy as eager. The model is its own
    draft model, so every request has k drafts at every step (n-gram drafts of a random
    model come in every count, and those steps run eagerly)."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)
    model_dir = model_dir_factory("llama")
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(model_dir)}
    rng = random.Random(1)
    runs = [[rng.randrange(3, 200) for _ in range(n)] for n in (4, 7, 5)]
    prompts = [{"prompt_token_ids": r * 3} for r in runs]  # drafts from the first step on
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = LLM(model_dir, dtype="float32", max_num_seqs=8, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]

    platform = FakeGraphPlatform()
    monkeypatch.setattr(worker_module, "set_platform", lambda device: platform)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=16, block_size=4,
              speculative_config=spec)
    q = 1 + spec["num_speculative_tokens"]
    graphs = llm.engine_core.executor.worker.runner.graphs
    verify_sizes = [s for s in (1, 2, 4) if s * q <= 16]  # tokens within the largest decode's
    assert graphs.captured_sizes == {1: [1, 2, 4, 8, 16], q: verify_sizes}
    assert sorted(platform.captured) == sorted([16, 8, 4, 2, 1, *(s * q for s in verify_sizes)])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert graphs.replays[q] >= 3 and llm.stats().spec_decode_num_accepted_tokens > 0
