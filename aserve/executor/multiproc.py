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


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def worker_main(model_config: ModelConfig, block_size: int, device: str, enforce_eager: bool,
                max_num_seqs: int, distributed: DistributedConfig, threads: int) -> None:
    """Body of rank r > 0: join the group, load the shard, serve control messages until told
    to stop (or until rank 0 goes away, which breaks the control channel)."""
    torch.set_num_threads(threads)
    worker = Worker(model_config, block_size, device, local_rank=distributed.local_rank,
                    enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                    distributed=distributed)
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


def spawn_ranks(model_config: ModelConfig, block_size: int, device: str, enforce_eager: bool,
                max_num_seqs: int, world_size: int, tp_size: int, nnodes: int, node_rank: int,
                master_addr: str, master_port: int, first_local_rank: int
                ) -> list[multiprocessing.Process]:
    """Start this node's ranks from `first_local_rank` on, as daemon processes."""
    per_node = world_size // nnodes
    context = multiprocessing.get_context("spawn")
    procs = []
    for local in range(first_local_rank, per_node):
        config = DistributedConfig(node_rank * per_node + local, world_size, local, master_addr,
                                   master_port, tp_size=tp_size)
        procs.append(context.Process(
            target=worker_main, name=f"aserve-rank{config.rank}", daemon=True,
            args=(model_config, block_size, device, enforce_eager, max_num_seqs, config,
                  _threads_per_rank(per_node))))
        procs[-1].start()
    return procs


def run_worker_node(model_config: ModelConfig, block_size: int, device: str,
                    enforce_eager: bool, max_num_seqs: int, world_size: int, tp_size: int,
                    nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
    """A node other than 0: its ranks only (no scheduler, no server), until node 0 stops them;
    its first rank runs in this process, the others are spawned."""
    procs = spawn_ranks(model_config, block_size, device, enforce_eager, max_num_seqs,
                        world_size, tp_size, nnodes, node_rank, master_addr, master_port, 1)
    per_node = world_size // nnodes
    try:
        worker_main(model_config, block_size, device, enforce_eager, max_num_seqs,
                    DistributedConfig(node_rank * per_node, world_size, 0, master_addr,
                                      master_port, tp_size=tp_size), _threads_per_rank(per_node))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class MultiprocExecutor(Executor):
    def __init__(self, model_config: ModelConfig, block_size: int, device: str,
                 enforce_eager: bool, max_num_seqs: int, world_size: int, tp_size: int,
                 nnodes: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None) -> None:
        super().__init__()
        self.world_size = world_size
        self.max_batches_in_flight = world_size // tp_size  # one per pipeline stage
        self._stopping = False
        port = master_port or free_port()
        self.procs = spawn_ranks(model_config, block_size, device, enforce_eager, max_num_seqs,
                                 world_size, tp_size, nnodes, 0, master_addr, port, 1)
        try:
            self.call(torch.set_num_threads, _threads_per_rank(world_size // nnodes))
            self.worker = self.call(Worker, model_config, block_size, device,
                                    enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                                    distributed=DistributedConfig(0, world_size, 0, master_addr,
                                                                  port, tp_size=tp_size))
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
