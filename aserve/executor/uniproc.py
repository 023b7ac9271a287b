"""The executor for one rank: the worker is called directly, or from one worker thread.

`execute_model` runs a step in the calling (engine) thread. `submit` hands it to the single
"aserve-worker" thread and returns a future, so that the engine can schedule the next step while
this one runs (async scheduling); steps still run one at a time, in submission order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from aserve.config import ModelConfig, ModelInfo
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.runner.worker import Worker


class UniProcExecutor:
    def __init__(self, model_config: ModelConfig, block_size: int, device: str = "auto",
                 enforce_eager: bool = False, max_num_seqs: int = 256) -> None:
        self.worker = Worker(model_config, block_size, device, enforce_eager=enforce_eager,
                             max_num_seqs=max_num_seqs)
        self._thread: ThreadPoolExecutor | None = None

    def model_info(self) -> ModelInfo:
        return self.worker.model_info()

    def initialize_kv_cache(self, kv_cache_memory: int | None, num_kv_blocks: int | None,
                            max_useful_blocks: int, gpu_memory_utilization: float,
                            max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Size and allocate the KV cache (see `Worker`); return its number of blocks."""
        num_blocks = num_kv_blocks
        if num_blocks is None:
            num_bytes = self.worker.kv_cache_bytes(kv_cache_memory, gpu_memory_utilization,
                                                   max_num_batched_tokens, max_num_seqs)
            num_blocks = min(self.worker.num_blocks_for_bytes(num_bytes), max_useful_blocks)
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="aserve-worker")
        return self._thread.submit(self.execute_model, scheduler_output)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
