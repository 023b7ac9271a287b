"""The executor for several ranks on one node: rank 0 here, ranks 1..N-1 spawned processes.

    rank 0 (engine thread)                         rank r > 0 (`worker_main`)
    Worker + scheduler-side runner                 Worker, no scheduler state
    ("kv", num_blocks)   ── broadcast_control ──►  allocate the same cache (and graphs)
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
from aserve.distributed import DistributedConfig, broadcast_control, shutdown_distributed
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
                max_num_seqs: int, distributed: DistributedConfig) -> None:
    """Body of rank r > 0: join the group, load the shard, serve control messages until told
    to stop (or until rank 0 goes away, which breaks the control channel)."""
    torch.set_num_threads(_threads_per_rank(distributed.world_size))
    worker = Worker(model_config, block_size, device, local_rank=distributed.rank,
                    enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                    distributed=distributed)
    try:
        while True:
            message = broadcast_control()
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


class MultiprocExecutor(Executor):
    def __init__(self, model_config: ModelConfig, block_size: int, device: str,
                 enforce_eager: bool, max_num_seqs: int, world_size: int,
                 master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
        super().__init__()
        self.world_size = world_size
        self._stopping = False
        config = DistributedConfig(0, world_size, master_addr, master_port or free_port())
        context = multiprocessing.get_context("spawn")
        self.procs = [
            context.Process(target=worker_main, name=f"aserve-rank{rank}", daemon=True,
                            args=(model_config, block_size, device, enforce_eager, max_num_seqs,
                                  DistributedConfig(rank, world_size, config.master_addr,
                                                    config.master_port)))
            for rank in range(1, world_size)]
        for proc in self.procs:
            proc.start()
        torch.set_num_threads(_threads_per_rank(world_size))
        try:
            self.worker = Worker(model_config, block_size, device, enforce_eager=enforce_eager,
                                 max_num_seqs=max_num_seqs, distributed=config)
        except BaseException:
            self._kill_workers()
            raise
        self.worker.runner.publish_inputs = lambda inputs: broadcast_control(("step", inputs))
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
        broadcast_control(message)

    def shutdown(self) -> None:
        """Stop every rank: ask politely, then terminate whatever is left."""
        self._stopping = True
        super().shutdown()
        if all(proc.is_alive() for proc in self.procs):
            try:
                broadcast_control(("shutdown",))
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
