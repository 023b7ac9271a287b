"""`Worker`: one rank — its platform and device, its model runner, its share of the KV cache,
and (where the platform has graphs, unless `enforce_eager`) its captured decode graphs.

KV-cache sizing, in order: `num_kv_blocks` if given; else `kv_cache_memory` bytes if given; else
the platform's default budget (CPU: host memory); else (GPUs) by profiling:

    kv bytes = gpu_memory_utilization * total - (memory others held at start) - (peak of a
               forward of the largest step, weights included)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from aserve.backends import Platform, set_platform
from aserve.config import (
    DraftConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    ModelInfo,
)
from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.distributed import (
    DistributedConfig,
    get_ep_size,
    get_moe_combine,
    get_pp_size,
    get_sp_size,
    get_tp_rank,
    get_tp_size,
    init_distributed,
    stage_layers,
)
from aserve.kv_transfer import KVConnectorRole, create_connector, kv_cache_key
from aserve.models import effective_max_model_len
from aserve.runner.core_share import core_share_for_worker
from aserve.runner.graphs import default_capture_sizes
from aserve.runner.kv_cache import kv_buffer_ids, kv_cache_bytes_per_block
from aserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, model_config: ModelConfig, block_size: int,
                 device: str | Platform = "auto", local_rank: int = 0,
                 enforce_eager: bool = False, max_num_seqs: int = 256,
                 distributed: DistributedConfig | None = None,
                 publish_inputs: Callable[..., None] | None = None,
                 kv_transfer_config: KVTransferConfig | None = None,
                 gather_kv_reports: Callable[[], list[KVConnectorOutput]] | None = None,
                 draft: DraftConfig | None = None, num_speculative_tokens: int = 0) -> None:
        self.enforce_eager, self.max_num_seqs = enforce_eager, max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        self.platform: Platform = set_platform(device)
        self.device: torch.device = self.platform.device_for_rank(local_rank)
        self.platform.set_device(self.device)
        if distributed is not None:  # before the model is built: layers read their TP place
            init_distributed(replace(distributed, backend=self.platform.dist_backend))
        self.platform.seed_everything(model_config.seed)
        self.free_at_start, _ = self.platform.mem_info(self.device)
        self.platform.reset_peak_memory()
        self.model_config = model_config
        self.block_size = block_size
        self.runner = ModelRunner(model_config, block_size, self.platform, self.device,
                                  publish_inputs, gather_kv_reports, draft)
        self.kv_transfer_config = kv_transfer_config
        # (built in the worker thread, whose OpenMP team it sizes)
        self.core_share = core_share_for_worker(self.platform.computes_on_host
                                                and distributed is None)
        arch = self.runner.arch
        self.kv_cache_key = kv_cache_key(model_config.model, str(arch.dtype), block_size,
                                         get_tp_size(), self.runner.num_kv_heads, arch.head_dim,
                                         arch.layer_windows)

    def model_info(self) -> ModelInfo:
        arch = self.runner.arch
        return ModelInfo(
            vocab_size=arch.vocab_size,
            max_model_len=effective_max_model_len(arch, self.model_config.max_model_len),
            eos_token_ids=tuple(arch.eos_token_ids),
            default_max_num_batched_tokens=self.platform.default_max_num_batched_tokens,
            layer_windows=arch.layer_windows,
            kv_cache_key=self.kv_cache_key,
            quantization=self.runner.quantization,
            hidden_size=arch.hidden_size,
            pooler=self.model_config.pooler,
        )

    def needs_profiling(self, kv_cache_memory: int | None) -> bool:
        """Whether `kv_cache_bytes` will run a profiling forward (every rank must then run one)."""
        return kv_cache_memory is None and self.platform.default_kv_cache_bytes() is None

    def kv_cache_bytes(self, kv_cache_memory: int | None, gpu_memory_utilization: float,
                       max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """The KV cache's budget in bytes (see the module docstring)."""
        if kv_cache_memory is not None:
            return kv_cache_memory
        default = self.platform.default_kv_cache_bytes()
        if default is not None:
            return default
        self.runner.profile_run(max_num_batched_tokens, max_num_seqs)
        peak = self.platform.peak_memory_bytes()
        _, total = self.platform.mem_info(self.device)
        held_by_others = total - self.free_at_start
        budget = int(gpu_memory_utilization * total) - held_by_others - peak
        logger.info("KV cache: %.2f GiB = %.2f x %.2f GiB total - %.2f GiB held by others - "
                    "%.2f GiB peak of a %d-token forward", budget / 2**30,
                    gpu_memory_utilization, total / 2**30, held_by_others / 2**30,
                    peak / 2**30, max_num_batched_tokens)
        self.platform.empty_cache()
        if budget <= 0:
            raise ValueError(
                f"No memory left for the KV cache: {gpu_memory_utilization:.0%} of "
                f"{total / 2**30:.1f} GiB minus {held_by_others / 2**30:.1f} GiB used by others "
                f"minus a {peak / 2**30:.1f} GiB forward peak. Raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens, or give --kv-cache-memory.")
        return budget

    def num_blocks_for_bytes(self, num_bytes: int,
                             kv_cache_groups: Sequence[KVCacheGroupSpec]) -> int:
        """Blocks that fit in `num_bytes` on the stage holding the most KV buffers (every
        stage gets the same block count)."""
        arch = self.runner.arch
        num_buffers = max(len(kv_buffer_ids(kv_cache_groups, stage_layers(arch.num_layers, s)))
                          for s in range(get_pp_size()))
        per_block = kv_cache_bytes_per_block(arch, self.block_size, num_buffers,
                                             self.runner.num_kv_heads)
        if self.runner.drafter is not None:  # the draft model's buffers share the block ids
            per_block += self.runner.drafter.bytes_per_block(self.block_size)
        return num_bytes // per_block

    def initialize_kv_cache(self, num_blocks: int,
                            kv_cache_groups: Sequence[KVCacheGroupSpec]) -> None:
        """Allocate the cache; then, where the platform has graphs, capture decode batches (not
        under the MoE all-to-all combine, whose split sizes the host reads every step, nor
        under sequence parallelism, whose rows the graphs do not split; nor for the pooling
        runner, whose requests are prefill only)."""
        self.runner.initialize_kv_cache(num_blocks, kv_cache_groups)
        if self.kv_transfer_config is not None:
            connector = create_connector(self.kv_transfer_config, KVConnectorRole.WORKER,
                                         self.kv_cache_key, kv_cache_groups, self.block_size,
                                         get_tp_rank(), get_tp_size())
            self.runner.bind_kv_connector(connector)
        all_to_all = get_ep_size() > 1 and get_moe_combine() == "all-to-all"
        if (self.platform.supports_graphs and not self.enforce_eager and get_pp_size() == 1
                and not all_to_all and get_sp_size() == 1 and self.model_config.pooler is None):
            max_blocks = -(-self.model_info().max_model_len // self.block_size)
            self.runner.capture_graphs(default_capture_sizes(self.max_num_seqs), max_blocks,
                                       self.num_speculative_tokens)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.core_share is not None:
            self.core_share.step()
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Stop what outlives a step: the KV connector's threads and sockets."""
        self.runner.kv_hooks.shutdown()
