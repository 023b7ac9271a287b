"""`EngineCore`: the scheduler loop — schedule, execute, update — over one executor.

The offline `LLM` calls `step()` directly. The server runs `run_engine_thread` in one dedicated
thread: drain the inbox (blocking only when idle) → step → publish, until `Shutdown`. Requests
reaching here are already validated by the frontend.
"""

from __future__ import annotations

import logging
import queue
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace

from aserve.config import ModelInfo
from aserve.core.kv_cache_utils import blocks_per_request, make_kv_cache_groups
from aserve.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    StepOutputs,
)
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.messages import (
    AbortRequests,
    AddRequest,
    Command,
    EngineCoreOutputs,
    EngineDead,
    EngineMessage,
    EngineReady,
    ResetPrefixCache,
    Shutdown,
)
from aserve.engine.step_log import StepLog
from aserve.executor import multiproc
from aserve.executor.base import Executor
from aserve.executor.factory import make_executor
from aserve.kv_transfer import KVConnectorBase, KVConnectorRole, create_connector
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KV_POLL_S = 0.002  # a step with nothing to compute, only KV transfers to wait for, waits this
KV_IDLE_POLL_S = 0.05  # no request left, only blocks held for a peer: the inbox waits this
WARMUP_TOKENS = 2  # each warm-up prompt's output: a prefill, then a decode (`_warm_up`)


def run_worker_node(args: EngineArgs) -> None:
    """Node `args.node_rank` > 0 of a multi-node engine: run its ranks until node 0 stops."""
    multiproc.run_worker_node(args.worker_spec(), args.rank_layout(), args.node_rank)


class EngineCore:
    """The scheduler and the executor of one engine.

    `shutdown()` stops the executor (its worker thread, every rank, the process groups) once;
    it also runs when the engine is garbage-collected and at interpreter exit, whichever comes
    first, so that an engine dropped without a shutdown leaves nothing running behind it.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.executor: Executor = make_executor(args.worker_spec(), args.rank_layout())
        # Holds the executor, not the engine: `del engine` can still collect the engine.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        try:
            self._init(args)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, args: EngineArgs) -> None:
        self.model_info: ModelInfo = self.executor.model_info()
        if args.max_num_batched_tokens is None:
            args = replace(args, max_num_batched_tokens=(
                self.model_info.default_max_num_batched_tokens))
        self.max_num_batched_tokens = args.max_num_batched_tokens
        max_model_len = self.model_info.max_model_len
        groups = make_kv_cache_groups(self.model_info.layer_windows, args.block_size)
        # What one request of maximal length holds at once, over every group (a sliding
        # window's group: about its window, not the whole length).
        per_request = blocks_per_request(groups, max_model_len, args.max_num_batched_tokens)
        # No more blocks than `max_num_seqs` such requests can use, plus the null block.
        max_useful_blocks = args.max_num_seqs * per_request + 1
        num_blocks = self.executor.initialize_kv_cache(
            groups, args.kv_cache_memory, args.num_kv_blocks, max_useful_blocks,
            args.gpu_memory_utilization, args.max_num_batched_tokens, args.max_num_seqs)
        if num_blocks - 1 < per_request:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {args.block_size} tokens (one of "
                f"them the null block), but one request of max_model_len={max_model_len} "
                f"tokens needs {per_request} at once ({len(groups)} KV cache group(s)): it "
                "could never run. Give the cache more memory (kv_cache_memory / num_kv_blocks "
                "/ gpu_memory_utilization) or lower max_model_len.")
        self.num_blocks = num_blocks
        self.num_steps = 0
        self.forward_seconds = 0.0  # the model's own time, summed over steps
        self.step_log = StepLog()  # recent steps' composition, read by the server's dashboard
        self.kv_cache_groups = groups
        self.kv_connector: KVConnectorBase | None = None
        if args.kv_transfer_config is not None:  # its scheduler side (each rank: a worker side)
            self.kv_connector = create_connector(
                args.kv_transfer_config, KVConnectorRole.SCHEDULER, self.model_info.kv_cache_key,
                groups, args.block_size, 0, args.tensor_parallel_size)
        self.scheduler = Scheduler(args.scheduler_config(max_model_len),
                                   args.cache_config(num_blocks, groups), self.kv_connector)
        self.async_scheduling = args.async_scheduling
        self.max_in_flight = args.max_batches_in_flight
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        if args.warmup and self.kv_connector is None:
            self._warm_up(args)
        # (after the warm-up: the kernels' plans and buffers it made are startup objects too)
        logger.debug("%d objects frozen out of the cyclic GC",
                     self.executor.freeze_startup_heap())

    def _warm_up(self, args: EngineArgs) -> None:
        """Run two dummy prompts through the engine before it serves: one of the whole step
        budget, then one of half of it beside the first's decode. A user's first steps then
        pay none of the one-time costs (the first touches of the activation buffers, of the
        kernels' packed weights and plans, which leave a cold step far slower than a warm one;
        docs/benchmarks/serving-latency.md, "Spreading a prompt over the steps"), and the
        step-cost model starts from steps of two sizes (the first, cold one is left out)
        instead of guessing (half the budget beside decodes) until the load has shown it two.
        Whatever the prompts leave (cached blocks, counters, the step log) is cleared; the
        learnt step costs stay. The pooling runner's are pooled prompts (it samples nothing)."""
        n = min(self.max_num_batched_tokens, self.model_info.max_model_len - WARMUP_TOKENS)
        groups, budget = self.kv_cache_groups, self.max_num_batched_tokens
        while n >= args.block_size and (
                blocks_per_request(groups, n + WARMUP_TOKENS, budget)
                + blocks_per_request(groups, n // 2 + WARMUP_TOKENS, budget) >= self.num_blocks):
            n //= 2
        if n < args.block_size:
            return  # a cache too small to spare: nothing to learn a cost from
        params = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
        pooler = self.model_info.pooler
        pooling = (PoolingParams(pooler.pooling_type, pooler.normalize)
                   if pooler is not None else None)
        vocab = self.model_info.vocab_size
        for i, length in enumerate((n, n // 2)):
            prompt = [(7919 * (t + i) + 1) % vocab for t in range(length)]
            self.add_request(Request(f"aserve-warmup-{i}", prompt, params,
                                     pooling_params=pooling))
        while self.has_work():
            self.step()
        self.scheduler.reset_prefix_cache()
        kv = self.scheduler.kv_cache_manager
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0
        self.num_steps, self.forward_seconds, self.step_log = 0, 0.0, StepLog()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        finished = self.scheduler.finish_requests(request_ids)
        return [EngineCoreOutput(r.request_id, [], finish_reason=r.finish_reason) for r in finished]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Unfinished requests, steps in flight whose outputs are still to collect, or blocks
        the KV connector still moves (their leases expire only while steps run)."""
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or self.scheduler.has_kv_transfers())

    def _wait_for_transfers(self, scheduler_output: SchedulerOutput) -> None:
        """A step with nothing to compute only polls the KV connector: not in a hot loop."""
        if self.kv_connector is not None and scheduler_output.is_empty and not self._in_flight:
            time.sleep(KV_POLL_S)

    def step(self) -> StepOutputs:
        if self.async_scheduling:
            return self._step_overlapped()
        if not self.has_work():
            return StepOutputs()
        scheduler_output = self.scheduler.schedule()
        self._wait_for_transfers(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _step_overlapped(self) -> StepOutputs:
        """Schedule step N+1 while step N runs in the worker thread, start N+1 as soon as N
        is done, then turn N's tokens into outputs while N+1 runs.

            engine thread:  schedule N+1 | wait N | submit N+1 | update N, publish | schedule N+2
            worker thread:  ====== forward N =====|============ forward N+1 ==================

        Under pipeline parallelism up to one batch per stage is in flight: the engine waits for
        the oldest only when the pipeline is full or there is nothing new to start.
        """
        scheduler_output = None
        if self.scheduler.has_unfinished_requests() or self.scheduler.has_kv_transfers():
            scheduler_output = self.scheduler.schedule()
            self._wait_for_transfers(scheduler_output)
        nothing_new = scheduler_output is None or not scheduler_output.total_num_scheduled_tokens
        done = None
        if self._in_flight and (len(self._in_flight) >= self.max_in_flight or nothing_new):
            oldest, future = self._in_flight.popleft()
            done = (oldest, future.result())
        if scheduler_output is not None:
            self._in_flight.append((scheduler_output, self.executor.submit(scheduler_output)))
        return self._update(*done) if done is not None else StepOutputs()

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> StepOutputs:
        self.num_steps += 1
        self.forward_seconds += runner_output.forward_seconds
        num_decode = scheduler_output.num_decode_tokens
        if scheduler_output.total_num_scheduled_tokens:
            self.step_log.record(scheduler_output.total_num_scheduled_tokens - num_decode,
                                 num_decode, runner_output.forward_seconds)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def step_kv_transfers(self) -> None:
        """One step of the KV connector alone, waited for (steps in flight first): the
        workers learn of the transfers the last steps started (a producer's handles) and
        report the ones done. For the offline `LLM`, which steps only inside `generate`."""
        while self._in_flight:
            scheduler_output, future = self._in_flight.popleft()
            self._update(scheduler_output, future.result())
        scheduler_output = self.scheduler.schedule()
        self._update(scheduler_output, self.executor.execute_model(scheduler_output))

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor (waiting for a step in flight); once, whoever calls first."""
        self._finalizer()

    def run_busy_loop(self, inbox: queue.SimpleQueue[Command],
                      publish: Callable[[EngineMessage], None]) -> None:
        """Serve commands and step until `Shutdown`. Blocks on the inbox only when idle (when
        only blocks held for a peer are left, for `KV_IDLE_POLL_S` at a time). Stats are
        published with outputs, and whenever they change (a transfer freeing blocks)."""
        published = None
        while True:
            commands = []
            if not self.has_work():
                commands.append(inbox.get())
            elif not self.scheduler.has_unfinished_requests() and not self._in_flight:
                try:
                    commands.append(inbox.get(timeout=KV_IDLE_POLL_S))
                except queue.Empty:
                    pass
            while True:
                try:
                    commands.append(inbox.get_nowait())
                except queue.Empty:
                    break
            aborted: list[EngineCoreOutput] = []
            for command in commands:
                if isinstance(command, Shutdown):
                    return
                if isinstance(command, AddRequest):
                    self.add_request(command.request)
                elif isinstance(command, AbortRequests):
                    aborted += self.abort_requests(command.request_ids)
                elif isinstance(command, ResetPrefixCache):
                    command.reply(self.reset_prefix_cache())
            outputs = self.step()
            outputs.outputs[:0] = aborted
            stats = self.stats()
            if outputs or stats != published:
                publish(EngineCoreOutputs(outputs, stats))
                published = stats


def run_engine_thread(args: EngineArgs, inbox: queue.SimpleQueue[Command],
                      publish: Callable[[EngineMessage], None]) -> None:
    """Body of the engine thread: build the engine, announce it, serve until `Shutdown`.

    Any exception ends the thread with `EngineDead`, so that the frontend fails every in-flight
    request and reports itself unhealthy instead of hanging.
    """
    try:
        core = EngineCore(args)
    except Exception as e:  # noqa: BLE001 - reported to the frontend, which re-raises it
        logger.exception("The engine failed to start")
        publish(EngineDead(f"The engine failed to start: {type(e).__name__}: {e}"))
        return
    # A rank that dies is reported from the executor's watcher thread: the frontend fails
    # in-flight requests and turns unhealthy even while this thread waits on a collective.
    core.executor.on_failure = lambda reason: publish(EngineDead(f"The engine failed: {reason}"))
    publish(EngineReady(core.model_info, core.num_blocks, core.step_log))
    try:
        core.run_busy_loop(inbox, publish)
    except Exception as e:  # noqa: BLE001
        logger.exception("The engine thread failed")
        publish(EngineDead(f"The engine failed: {type(e).__name__}: {e}"))
    finally:
        core.shutdown()
