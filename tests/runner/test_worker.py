"""The worker sizes the KV cache: blocks given, bytes given, the platform's default, or (GPUs)
by profiling the largest step under `gpu_memory_utilization` — checked with a fake platform that
reports device memory like a GPU would, on the real CPU model path."""

from __future__ import annotations

import pytest
import torch

from aserve.backends import CpuPlatform
from aserve.config import ModelConfig
from aserve.core.kv_cache_utils import make_kv_cache_groups
from aserve.runner.kv_cache import kv_cache_bytes_per_block
from aserve.runner.worker import Worker

GiB = 1 << 30


class ProfiledPlatform(CpuPlatform):
    """A CPU that sizes its cache like a GPU: no default budget; memory and peak are scripted."""

    def __init__(self, total: int, free: int, peak: int) -> None:
        super().__init__()
        self.total, self.free, self.peak = total, free, peak
        self.calls: list[str] = []

    def mem_info(self, device=None):
        return self.free, self.total

    def default_kv_cache_bytes(self):
        return None

    def reset_peak_memory(self):
        self.calls.append("reset")

    def peak_memory_bytes(self):
        self.calls.append("peak")
        return self.peak


@pytest.fixture(scope="module")
def model_dir(model_dir_factory):
    return model_dir_factory("llama")


def test_profiled_budget_is_utilization_minus_others_minus_forward_peak(model_dir, monkeypatch):
    platform = ProfiledPlatform(total=80 * GiB, free=70 * GiB, peak=3 * GiB)
    worker = Worker(ModelConfig(str(model_dir), dtype="float32"), 16, platform)
    forwards = []
    monkeypatch.setattr(worker.runner, "profile_run",
                        lambda n, r: forwards.append((n, r)) or platform.calls.append("forward"))
    budget = worker.kv_cache_bytes(None, 0.5, max_num_batched_tokens=512, max_num_seqs=8)
    assert budget == 40 * GiB - 10 * GiB - 3 * GiB
    assert forwards == [(512, 8)] and platform.calls == ["reset", "forward", "peak"]


def test_no_memory_left_is_a_clear_error(model_dir):
    platform = ProfiledPlatform(total=10 * GiB, free=2 * GiB, peak=1 * GiB)
    worker = Worker(ModelConfig(str(model_dir), dtype="float32"), 16, platform)
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        worker.kv_cache_bytes(None, 0.9, max_num_batched_tokens=64, max_num_seqs=4)


def test_given_bytes_win_and_cpu_uses_its_default(model_dir):
    worker = Worker(ModelConfig(str(model_dir), dtype="float32"), 16, "cpu")
    assert worker.kv_cache_bytes(123 << 20, 0.9, 64, 4) == 123 << 20
    free, _ = CpuPlatform().mem_info()
    default = worker.kv_cache_bytes(None, 0.9, 64, 4)  # min(2 GiB, half the available memory)
    assert 0 < default <= min(2 * GiB, free * 0.6)
    arch = worker.runner.arch
    per_block = kv_cache_bytes_per_block(arch, 16, arch.num_layers, worker.runner.num_kv_heads)
    groups = make_kv_cache_groups(arch.layer_windows, 16)
    assert worker.num_blocks_for_bytes(10 * per_block + 1, groups) == 10


def test_profile_run_forwards_the_largest_step_without_a_cache(model_dir):
    worker = Worker(ModelConfig(str(model_dir), dtype="float32"), 16, "cpu")
    seen = []
    layer = worker.runner.model.attention_layers()[0]
    layer.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    worker.runner.profile_run(100, 7)
    assert seen == [100] and layer.kv_cache is None
    assert worker.device == torch.device("cpu")
