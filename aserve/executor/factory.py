"""`make_executor`: the executor for a rank layout, built from one `WorkerSpec`."""

from __future__ import annotations

from aserve.executor.base import Executor
from aserve.executor.multiproc import MultiprocExecutor
from aserve.executor.spec import RankLayout, WorkerSpec
from aserve.executor.uniproc import UniProcExecutor


def make_executor(spec: WorkerSpec, layout: RankLayout | None = None) -> Executor:
    """One rank in this process (layout None or a world of one), else tp × pp ranks (this
    node's others spawned)."""
    if layout is None or layout.world_size == 1:
        return UniProcExecutor(spec)
    return MultiprocExecutor(spec, layout)
