"""The executor for several ranks: rank 0 here, the node's other ranks spawned processes, and
(multi-node) the other nodes' ranks started there by `run_worker_node`.

    rank 0 (this process)                          rank r > 0 (`worker_main` → `handle`)
    Worker, in the "aserve-worker" thread          Worker, no scheduler state
    ProfileRun / InitKVCache ── send_control ───►  the same profiling forward / cache
    RunStep(inputs)      ── before each forward ─► run_model(inputs): same forward, own shard
    Stop()               ──────────────────────►  leave the process groups and exit

Messages are the dataclasses of `aserve.executor.messages`. Every rank runs the same model
forward on the same inputs; the layers' collectives (one all-reduce per row-parallel layer, the
vocab all-gather) pair up inside it. Rank 0 alone samples. A rank that dies is noticed by the
"aserve-rank-watcher" thread within a second (its process sentinel), which calls `on_failure`;
the engine turns that into `EngineDead`. `shutdown` stops every rank and destroys this
process's groups, so that another engine can be built in the same process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import wait

import torch

from aserve.core.kv_connector import KVConnectorOutput
from aserve.distributed import (
    DistributedConfig,
    flush_sends,
    recv_control,
    send_control,
    shutdown_distributed,
)
from aserve.executor.base import Executor, StartupHeap
from aserve.executor.messages import (
    KVConnectorReport,
    KVConnectorStep,
    RankMessage,
    RunStep,
    Stop,
    handle,
)
from aserve.executor.spec import RankLayout, WorkerSpec
from aserve.runner.input_batch import PreparedInputs

logger = logging.getLogger(__name__)


def _threads_per_rank(ranks_on_node: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks_on_node)


def publish_step(inputs: PreparedInputs | None, kv_metadata=None) -> None:
    """Rank 0's `publish_inputs`: every other rank runs the same step (None: a step of the
    KV connector's only)."""
    send_control(RunStep(inputs, kv_metadata) if inputs is not None
                 else KVConnectorStep(kv_metadata))


def gather_kv_reports() -> list[KVConnectorOutput]:
    """Rank 0, after a step with a KV connector: every other rank's report of it."""
    reports = []
    for rank in range(1, torch.distributed.get_world_size()):
        report = recv_control(rank)
        if not isinstance(report, KVConnectorReport):
            raise TypeError(f"rank {rank} answered {report!r}, not a KVConnectorReport")
        reports.append(report.output)
    return reports


def worker_main(spec: WorkerSpec, distributed: DistributedConfig, threads: int) -> None:
    """Body of rank r > 0: join the group, load the shard, serve rank messages until told to
    stop (or until rank 0 goes away, which breaks the control channel)."""
    torch.set_num_threads(threads)
    worker = None
    try:
        worker = spec.build(distributed)
        StartupHeap.freeze()  # (this process's own: it ends with the rank)
        while handle(worker, recv_control()):
            pass
    finally:
        if worker is not None:
            worker.shutdown()
        shutdown_distributed()


def spawn_ranks(spec: WorkerSpec, layout: RankLayout, node_rank: int
                ) -> list[multiprocessing.Process]:
    """Start this node's ranks but its first (local rank 0), as daemon processes."""
    context = multiprocessing.get_context("spawn")
    procs = []
    for local in range(1, layout.ranks_per_node):
        config = layout.config(node_rank, local)
        procs.append(context.Process(
            target=worker_main, name=f"aserve-rank{config.rank}", daemon=True,
            args=(spec, config, _threads_per_rank(layout.ranks_per_node))))
        procs[-1].start()
    return procs


def run_worker_node(spec: WorkerSpec, layout: RankLayout, node_rank: int) -> None:
    """A node other than 0: its ranks only (no scheduler, no server), until node 0 stops them;
    its first rank runs in this process, the others are spawned."""
    procs = spawn_ranks(spec, layout, node_rank)
    try:
        worker_main(spec, layout.config(node_rank, 0), _threads_per_rank(layout.ranks_per_node))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class MultiprocExecutor(Executor):
    def __init__(self, spec: WorkerSpec, layout: RankLayout) -> None:
        super().__init__()
        layout = layout.with_port()
        self.world_size = layout.world_size
        self.max_batches_in_flight = layout.num_stages  # one per stage
        self._stopping = False
        self.procs = spawn_ranks(spec, layout, 0)
        try:
            self.call(torch.set_num_threads, _threads_per_rank(layout.ranks_per_node))
            self.worker = self.call(spec.build, layout.config(0, 0), publish_step,
                                    gather_kv_reports)
        except BaseException:
            self.shutdown()  # the ranks, and rank 0's groups if it had joined them
            raise
        threading.Thread(target=self._watch, name="aserve-rank-watcher", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {proc.sentinel: proc for proc in self.procs}
        ready = wait(list(sentinels))
        if self._stopping:
            return
        proc = sentinels[ready[0]]
        reason = f"worker rank {proc.name} exited with code {proc.exitcode}"
        logger.error("%s; the engine cannot go on", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def _broadcast(self, message: RankMessage) -> None:
        send_control(message)

    def _shutdown(self) -> None:
        """Stop every rank: ask politely, then terminate whatever is left; leave the groups."""
        self._stopping = True
        super()._shutdown()
        if hasattr(self, "worker") and all(proc.is_alive() for proc in self.procs):
            try:
                send_control(Stop())
                flush_sends()
            except Exception:  # noqa: BLE001 - a rank died mid-way: terminate below
                pass
            for proc in self.procs:
                proc.join(timeout=10)
        self._kill_workers()
        shutdown_distributed()

    def _kill_workers(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
