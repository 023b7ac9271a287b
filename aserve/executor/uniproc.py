"""The executor for one rank: the worker lives in the engine thread and is called directly."""

from __future__ import annotations

from aserve.config import ModelConfig, ModelInfo
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.runner.worker import Worker


class UniProcExecutor:
    def __init__(self, model_config: ModelConfig, block_size: int, device: str = "cpu") -> None:
        self.worker = Worker(model_config, block_size, device)

    def model_info(self) -> ModelInfo:
        return self.worker.model_info()

    def initialize_kv_cache(self, kv_cache_memory: int, num_kv_blocks: int | None,
                            max_useful_blocks: int) -> int:
        """Size and allocate the KV cache; return its number of blocks."""
        num_blocks = num_kv_blocks or min(
            self.worker.num_blocks_for_memory(kv_cache_memory), max_useful_blocks)
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
