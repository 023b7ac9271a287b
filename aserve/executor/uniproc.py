"""The executor for one rank: the worker lives in this process (see `Executor`)."""

from __future__ import annotations

from aserve.config import ModelConfig
from aserve.executor.base import Executor
from aserve.runner.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, model_config: ModelConfig, block_size: int, device: str = "auto",
                 enforce_eager: bool = False, max_num_seqs: int = 256) -> None:
        super().__init__()
        self.worker = self.call(Worker, model_config, block_size, device,
                                enforce_eager=enforce_eager, max_num_seqs=max_num_seqs)
