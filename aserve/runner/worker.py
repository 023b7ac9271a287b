"""`Worker`: one rank — its device, its model runner, its share of the KV cache."""

from __future__ import annotations

import torch

from aserve.config import ModelConfig, ModelInfo
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.models import effective_max_model_len
from aserve.runner.kv_cache import num_blocks_for_memory
from aserve.runner.model_runner import ModelRunner


class Worker:
    def __init__(self, model_config: ModelConfig, block_size: int,
                 device: torch.device | str = "cpu") -> None:
        torch.manual_seed(model_config.seed)
        self.model_config = model_config
        self.block_size = block_size
        self.runner = ModelRunner(model_config, block_size, device)

    def model_info(self) -> ModelInfo:
        arch = self.runner.arch
        return ModelInfo(
            vocab_size=arch.vocab_size,
            max_model_len=effective_max_model_len(arch, self.model_config.max_model_len),
            eos_token_ids=tuple(arch.eos_token_ids),
        )

    def num_blocks_for_memory(self, kv_cache_memory: int) -> int:
        return num_blocks_for_memory(self.runner.arch, self.block_size, kv_cache_memory)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
