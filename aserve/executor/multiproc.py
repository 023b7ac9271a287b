"""The executor for several ranks: rank 0 here, the node's other ranks spawned processes, and
(multi-node) the other nodes' ranks started there by `run_worker_node`.

    rank 0 (engine thread)                         rank r > 0 (`worker_main`)
    Worker + scheduler-side runner                 Worker, no scheduler state
    ("kv", num_blocks)   ── send_control ───────►  allocate the same cache (and graphs)
    ("step", inputs)     ── before each forward ─► run_model(inputs): same forward, own shard
    ("shutdown",)        ──────────────────────►  leave the group and exit

Every rank runs the same model forward on the same inputs; the layers' collectives (one
all-reduce per row-parallel layer, the vocab all-gather) pair up inside it. Rank 0 alone samples.
A rank that dies is noticed by a watcher thread within a second (its process sentinel), which
calls `on_failure`; the engine turns that into `EngineDead`. `shutdown` stops every rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from aserve.config import ModelConfig
from aserve.distributed import (
    DistributedConfig,
    flush_sends,
    recv_control,
    send_control,
    shutdown_distributed,
)
from aserve.executor.base import Executor
from aserve.runner.worker import Worker

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _threads_per_rank(ranks_on_node: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks_on_node)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds: the arguments of its `Worker`."""

    model_config: ModelConfig
    block_size: int
    device: str
    enforce_eager: bool
    max_num_seqs: int

    def build(self, distributed: DistributedConfig) -> Worker:
        return Worker(self.model_config, self.block_size, self.device,
                      local_rank=distributed.local_rank, enforce_eager=self.enforce_eager,
                      max_num_seqs=self.max_num_seqs, distributed=distributed)


@dataclass(frozen=True)
class RankLayout:
    """How ranks are laid out: world = tp × pp ranks over `nnodes` nodes (rank = node × ranks
    per node + local rank; stage = rank // tp), meeting at master_addr:master_port."""

    world_size: int
    tp_size: int
    nnodes: int
    master_addr: str
    master_port: int
    pp_layer_partition: tuple[int, ...] | None = None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def config(self, node_rank: int, local_rank: int) -> DistributedConfig:
        return DistributedConfig(node_rank * self.ranks_per_node + local_rank, self.world_size,
                                 local_rank, self.master_addr, self.master_port,
                                 tp_size=self.tp_size,
                                 pp_layer_partition=self.pp_layer_partition)


def worker_main(spec: WorkerSpec, distributed: DistributedConfig, threads: int) -> None:
    """Body of rank r > 0: join the group, load the shard, serve control messages until told
    to stop (or until rank 0 goes away, which breaks the control channel)."""
    torch.set_num_threads(threads)
    worker = spec.build(distributed)
    try:
        while True:
            message = recv_control()
            kind = message[0]
            if kind == "step":
                worker.runner.run_model(message[1])
            elif kind == "kv":
                worker.initialize_kv_cache(message[1])
            elif kind == "profile":
                worker.runner.profile_run(*message[1:])
            elif kind == "shutdown":
                break
    finally:
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
        self.world_size = layout.world_size
        self.max_batches_in_flight = layout.world_size // layout.tp_size  # one per stage
        self._stopping = False
        self.procs = spawn_ranks(spec, layout, 0)
        try:
            self.call(torch.set_num_threads, _threads_per_rank(layout.ranks_per_node))
            self.worker = self.call(spec.build, layout.config(0, 0))
        except BaseException:
            self._kill_workers()
            raise
        self.worker.runner.publish_inputs = lambda inputs: send_control(("step", inputs))
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

    def _broadcast(self, message: tuple) -> None:
        send_control(message)

    def shutdown(self) -> None:
        """Stop every rank: ask politely, then terminate whatever is left."""
        self._stopping = True
        super().shutdown()
        if all(proc.is_alive() for proc in self.procs):
            try:
                send_control(("shutdown",))
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
