"""The executor for one rank: the worker lives in this process (see `Executor`)."""

from __future__ import annotations

from aserve.executor.base import Executor
from aserve.executor.spec import WorkerSpec


class UniProcExecutor(Executor):
    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__()
        try:
            self.worker = self.call(spec.build)
        except BaseException:
            self.shutdown()
            raise
