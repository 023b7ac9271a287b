"""What every executor shares: rank 0's `Worker` in this process, KV-cache sizing, and the one
"aserve-worker" thread in which rank 0 does all its torch work (see `Executor.call`).

`execute_model` runs a step and waits for it. `submit` starts it and returns a future, so that
the engine can schedule the next step while this one runs (async scheduling); steps still run
one at a time, in submission order. Under pipeline parallelism
(`max_batches_in_flight` > 1) the worker thread only starts a step (this stage's forward) and an
"aserve-collector" thread waits for its logits and samples, so that up to one batch per stage is
in flight. `_broadcast` sends a rank message (`aserve.executor.messages`) to the other ranks
(a no-op with one rank).

`shutdown()` runs once, whoever calls it first (the engine's shutdown, a finalizer, interpreter
exit); later calls return at once.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from aserve.config import KVCacheGroupSpec, ModelInfo
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.executor.messages import InitKVCache, ProfileRun, RankMessage
from aserve.runner.worker import Worker

T = TypeVar("T")


class StartupHeap:
    """The objects alive once an engine is ready to serve (imported modules, the model and its
    packed weights, the tokenizer: ~230k objects for a small model), moved out of the cyclic
    GC's reach into its permanent generation (`gc.freeze`). Otherwise every full collection
    walks them all again (~260 ms on a 2-vCPU host, the whole process stalled under the GIL:
    every stream's next token, the event loop), whenever enough of the steps' objects have
    outlived the young generations; frozen, it walks only what serving made since.

    Process-wide, hence counted: the first engine to be warm freezes (garbage collected
    first, so that none is frozen); engines built while it holds the freeze only count
    themselves in, their own objects left to the collector (a test suite or notebook that
    makes and drops engines beside a long-lived one has them collected as before); the last
    to shut down hands every frozen object back to the collector. An app that mounts the
    server has its own heap of the moment frozen with the engine's (reference counting
    still frees what it drops)."""

    _lock = threading.Lock()
    _holders = 0

    @classmethod
    def freeze(cls) -> int:
        """Freeze what is alive now, unless a freeze is held already; returns how many
        objects are frozen."""
        with cls._lock:
            if cls._holders == 0:
                gc.collect()
                gc.freeze()
            cls._holders += 1
            return gc.get_freeze_count()

    @classmethod
    def thaw(cls) -> None:
        """One holder fewer; the last one unfreezes every object."""
        with cls._lock:
            cls._holders -= 1
            if cls._holders == 0:
                gc.unfreeze()


class Executor:
    """Subclasses build `self.worker` through `self.call(Worker, ...)`: in the worker thread."""

    worker: Worker

    max_batches_in_flight = 1  # pipeline parallelism: one batch per stage

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="aserve-worker")
        self._collector: ThreadPoolExecutor | None = None
        self._shutdown_lock = threading.Lock()
        self.is_shut_down = False
        self._heap_frozen = False
        # Called (from any thread) when a rank dies; set by the engine thread.
        self.on_failure: Callable[[str], None] | None = None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` in the worker thread and wait for it.

        Every torch call of this rank goes through the one worker thread: CPU kernels
        parallelise with OpenMP, whose thread pools belong to the thread that starts a parallel
        region, and two such threads (say the engine thread loading the model and the worker
        thread running it) leave two pools fighting over the cores: small ops then run several
        times slower (docs/benchmarks/throughput.md, "Async scheduling on and off").
        """
        return self._thread.submit(fn, *args, **kwargs).result()

    def freeze_startup_heap(self) -> int:
        """Once the engine is warm: its objects out of the cyclic GC until `shutdown`
        (`StartupHeap`); returns how many objects are frozen."""
        if self._heap_frozen:
            return gc.get_freeze_count()
        self._heap_frozen = True
        return StartupHeap.freeze()

    def _broadcast(self, message: RankMessage) -> None:
        """Send a rank message to ranks 1..N-1, in order, without waiting for them."""
        return None  # one rank: nobody to tell

    def model_info(self) -> ModelInfo:
        return self.worker.model_info()

    def initialize_kv_cache(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...],
                            kv_cache_memory: int | None, num_kv_blocks: int | None,
                            max_useful_blocks: int, gpu_memory_utilization: float,
                            max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Size the cache on rank 0 (see `Worker`; every rank holds the same share of kv heads,
        hence the same bytes per block), allocate it on every rank, laid out for
        `kv_cache_groups`; return its block count."""
        return self.call(self._initialize_kv_cache, kv_cache_groups, kv_cache_memory,
                         num_kv_blocks, max_useful_blocks, gpu_memory_utilization,
                         max_num_batched_tokens, max_num_seqs)

    def _initialize_kv_cache(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...],
                             kv_cache_memory: int | None, num_kv_blocks: int | None,
                             max_useful_blocks: int, gpu_memory_utilization: float,
                             max_num_batched_tokens: int, max_num_seqs: int) -> int:
        num_blocks = num_kv_blocks
        if num_blocks is None:
            if self.worker.needs_profiling(kv_cache_memory):
                self._broadcast(ProfileRun(max_num_batched_tokens, max_num_seqs))
            num_bytes = self.worker.kv_cache_bytes(kv_cache_memory, gpu_memory_utilization,
                                                   max_num_batched_tokens, max_num_seqs)
            num_blocks = min(self.worker.num_blocks_for_bytes(num_bytes, kv_cache_groups),
                             max_useful_blocks)
        self._broadcast(InitKVCache(num_blocks, kv_cache_groups))
        self.worker.initialize_kv_cache(num_blocks, kv_cache_groups)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waited for."""
        return self.submit(scheduler_output).result()

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """One step, started in the worker thread; the future holds its output."""
        if self.max_batches_in_flight == 1:
            return self._thread.submit(self.worker.execute_model, scheduler_output)
        return self._submit_pipelined(scheduler_output)

    def _submit_pipelined(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start the step in the worker thread, then hand it to the collector thread, which
        waits for its logits from the last stage: the worker is free to start the next one."""
        if self._collector is None:
            self._collector = ThreadPoolExecutor(1, thread_name_prefix="aserve-collector")
        runner, done = self.worker.runner, Future()

        def start() -> None:
            try:
                step = runner.start_step(scheduler_output)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `done`
                done.set_exception(e)
                return
            self._collector.submit(runner.finish_step, step).add_done_callback(
                lambda f: done.set_exception(f.exception()) if f.exception()
                else done.set_result(f.result()))

        self._thread.submit(start)
        return done

    def shutdown(self) -> None:
        """Wait for the steps in flight, then stop the threads and the ranks; once."""
        with self._shutdown_lock:
            if self.is_shut_down:
                return
            self.is_shut_down = True
            try:
                self._shutdown()
            finally:
                if self._heap_frozen:
                    StartupHeap.thaw()

    def _shutdown(self) -> None:
        """Stop this process's threads (a multi-rank executor also stops its ranks). Submits
        nothing: at interpreter exit the pools take no new work."""
        self._thread.shutdown(wait=True)  # every step started, and handed to the collector
        if self._collector is not None:
            self._collector.shutdown(wait=True)
            self._collector = None
        if hasattr(self, "worker"):
            self.worker.shutdown()  # the KV connector's threads and sockets
