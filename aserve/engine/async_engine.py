"""`AsyncEngine`: the asyncio side of the engine — an actor on the event loop.

It tokenizes and validates (long prompts off the loop), hands requests to the engine thread
through its inbox, and turns what the thread publishes into per-request streams of
`RequestOutput` deltas (detokenization and stop strings happen here, on the loop). The engine
thread never touches an asyncio object; this side never touches the scheduler.

    stream = await engine.add_request(request_id, prompt, params)   # validated, or ValueError
    async for output in stream: ...                                  # deltas until finished
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor

from aserve.config import ModelInfo
from aserve.core.kv_cache_utils import make_kv_cache_groups
from aserve.core.outputs import SchedulerStats
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.core import run_engine_thread
from aserve.engine.held_blocks import HeldBlocksBudget
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
from aserve.engine.output_processor import OutputProcessor
from aserve.engine.outputs import PoolingRequestOutput, RequestOutput
from aserve.engine.processor import PreparedRequest, ProcessedPrompt, Processor, PromptType
from aserve.engine.step_log import StepLog
from aserve.engine.tokenizer import Tokenizer
from aserve.kv_transfer import connector_class
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams

# Prompts longer than this (characters) are tokenized in a worker thread, off the event loop.
MAX_INLINE_TOKENIZE_CHARS = 2000
TOKENIZE_THREADS = 2
MAX_PENDING_OUTPUTS = 64  # unread outputs a stream keeps apart; later ones merge into the last
GRAMMAR_COMPILE_TIMEOUT_S = float(os.environ.get("ASERVE_GRAMMAR_COMPILE_TIMEOUT", 30))  # then 400


class EngineDeadError(RuntimeError):
    """The engine thread has failed; no request can be served."""


class RequestStream:
    """The outputs of one request, in order; iterating ends after the finished one. Leaving
    early (or `abort()`) aborts the request in the engine so its KV blocks come back.

    A reader that keeps up gets each output as it came. Past MAX_PENDING_OUTPUTS unread, the
    newest is merged into the last one waiting (`RequestOutput.add`, as vLLM's output
    collector merges them): a stream whose reader falls far behind holds its text so far and a
    bounded number of objects, not one per step."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.finished = False
        self._pending: collections.deque[RequestOutput] = collections.deque()
        self._error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        """On the loop: the next output, or the error that ends the stream after what is
        pending."""
        if isinstance(item, Exception):
            self._error = item
        elif len(self._pending) < MAX_PENDING_OUTPUTS:
            self._pending.append(item)
        else:
            self._pending[-1].add(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the stream's error once no output is pending."""
        while not self._pending and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if not self._pending:
            raise self._error
        return self._pending.popleft()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                try:
                    item = await self.get()
                except Exception:
                    self.finished = True
                    raise
                self.finished = item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def held_blocks_budget(args: EngineArgs, ready: EngineReady) -> HeldBlocksBudget | None:
    """The cap on blocks a KV producer holds for consumers, None where there is none."""
    config = args.kv_transfer_config
    cap = (None if config is None else
           connector_class(config).max_held_blocks(config, ready.num_kv_blocks))
    if cap is None:
        return None
    num_groups = len(make_kv_cache_groups(ready.model_info.layer_windows, args.block_size))
    return HeldBlocksBudget(cap, args.block_size, num_groups)


class AsyncEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.tokenizer = Tokenizer.from_dir(args.model_config().tokenizer_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.streams: dict[str, RequestStream] = {}
        self.stats = SchedulerStats()
        self.model_info: ModelInfo | None = None
        self.processor: Processor | None = None
        self.num_kv_blocks = 0
        self.step_log: StepLog | None = None  # the engine thread's, once it is ready
        self.held_blocks: HeldBlocksBudget | None = None  # a KV producer's cap, if it has one
        self.dead_error: str | None = None
        self.dead = asyncio.Event()  # set once the engine has died (not on a clean shutdown)
        self._thread: threading.Thread | None = None
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS,
                                                 thread_name_prefix="aserve-tokenize")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the engine thread (it loads the model) and wait until it serves."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(
            target=run_engine_thread, args=(self.args, self.inbox, self._publish),
            name="aserve-engine", daemon=True)
        self._thread.start()
        await self._ready

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.inbox.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._fail_all("The engine has shut down.")

    @property
    def is_running(self) -> bool:
        return self.model_info is not None and self.dead_error is None

    @property
    def num_requests_in_flight(self) -> int:
        """Engine requests (one per completion of each prompt, one per pooled prompt) added and
        not yet finished."""
        return len(self.output_processor.children) + len(self.output_processor.pooling)

    async def probe(self, timeout: float) -> str | None:
        """Generate one token (the pooling runner: pool one) through the whole engine; None if
        it did, else why not."""
        if not self.is_running:
            return self.dead_error or "The engine is not running."
        request_id = f"health-{uuid.uuid4().hex}"
        params = (PoolingParams() if self.model_info.pooler is not None
                  else SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))

        async def one_token() -> None:
            async for _ in self.generate(request_id, {"prompt_token_ids": [0]}, params):
                pass

        try:
            await asyncio.wait_for(one_token(), timeout)
        except asyncio.TimeoutError:
            self.abort(request_id)
            return f"The engine did not generate a token within {timeout:g} s."
        except EngineDeadError as e:
            return str(e)
        return None

    # ------------------------------------------------------------------ messages from the thread

    def _publish(self, message: EngineMessage) -> None:
        """Called in the engine thread: hop onto the event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_message, message)

    def _on_message(self, message: EngineMessage) -> None:
        if isinstance(message, EngineCoreOutputs):
            self.stats = message.stats
            ready, to_abort = self.output_processor.process_outputs(message.outputs)
            for output in ready:
                stream = self.streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finished:
                        del self.streams[output.request_id]
                if output.finished and self.held_blocks is not None:
                    self.held_blocks.release(output.request_id)  # (its blocks: in the stats)
            if to_abort:
                self.inbox.put(AbortRequests(tuple(to_abort)))
        elif isinstance(message, EngineReady):
            self.model_info = message.model_info
            self.num_kv_blocks = message.num_kv_blocks
            self.step_log = message.step_log
            self.held_blocks = held_blocks_budget(self.args, message)
            self.processor = Processor(
                self.tokenizer, message.model_info,
                any_whitespace=self.args.structured_outputs_any_whitespace,
                kv_transfer_config=self.args.kv_transfer_config, strict_max_tokens=True)
            self._ready.set_result(None)
        elif isinstance(message, EngineDead):
            self.dead_error = message.error
            self.dead.set()
            self._fail_all(message.error)
            if not self._ready.done():
                self._ready.set_exception(EngineDeadError(message.error))

    def _fail_all(self, error: str) -> None:
        for stream in self.streams.values():
            stream.put(EngineDeadError(error))
        self.streams.clear()

    # ------------------------------------------------------------------ requests

    def _check_alive(self) -> Processor:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self.processor is None:
            raise EngineDeadError("The engine is not running.")
        return self.processor

    async def process_prompt(self, prompt: PromptType | ProcessedPrompt,
                             add_special_tokens: bool = True) -> ProcessedPrompt:
        """Tokenize (off the loop when long) and validate; raises ValueError on bad input. A
        `ProcessedPrompt` (checked when it was made) is returned as it is."""
        processor = self._check_alive()
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text = prompt.get("prompt") if isinstance(prompt, Mapping) and (
            "prompt_token_ids" not in prompt) else prompt
        if isinstance(text, str) and len(text) > MAX_INLINE_TOKENIZE_CHARS:
            processor.check_text_length(text)  # one that cannot fit is refused at once
            return await self._tokenizing(processor.process_prompt, prompt, add_special_tokens)
        return processor.process_prompt(prompt, add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of a text that could fit in the context (`/tokenize`), off the loop when
        long; ValueError for a longer one."""
        processor = self._check_alive()
        if len(text) > MAX_INLINE_TOKENIZE_CHARS:
            processor.check_text_length(text)
            return await self._tokenizing(processor.encode, text, add_special_tokens)
        return processor.encode(text, add_special_tokens)

    async def _tokenizing(self, fn, *args):
        """`fn(*args)` in the tokenizer's own threads: not the loop's default pool (shared
        with template renders and joins), and at most TOKENIZE_THREADS texts in memory at once.
        A long text's encode releases the GIL (`Tokenizer.encode`), so the loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def prepare(self, prompt: PromptType | ProcessedPrompt,
                      params: SamplingParams | PoolingParams,
                      priority: int = 0) -> PreparedRequest:
        """Everything a request needs checked and computed before the engine sees it: the
        prompt tokenized (off the loop when long), the params checked against the model and
        the context, the default max_tokens, the constraint compiled (in the compiler's own
        worker processes, cheap first, killed past the timeout); ValueError on bad input."""
        processed = await self.process_prompt(prompt)
        return await self._check_alive().prepare_async(processed, params, priority,
                                                       GRAMMAR_COMPILE_TIMEOUT_S)

    def add(self, request_id: str, prepared: PreparedRequest) -> RequestStream:
        """Enqueue a prepared request; its outputs arrive as deltas on the stream. Raises
        ValueError for an id in use, ServerBusyError past a KV producer's cap."""
        processor = self._check_alive()
        if request_id in self.streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if self.held_blocks is not None and isinstance(prepared.params, SamplingParams) and (
                prepared.params.kv_transfer_params or {}).get("do_remote_decode"):
            # (raises ServerBusyError past the producer's cap)
            self.held_blocks.reserve(request_id, len(prepared.prompt.prompt_token_ids),
                                     self.stats.num_held_blocks)
        parent, requests = processor.make_requests(request_id, prepared, stream=True)
        stream = RequestStream(self, request_id)
        self.streams[request_id] = stream
        self.output_processor.add_request(parent, [r.request_id for r in requests])
        for request in requests:
            self.inbox.put(AddRequest(request))
        return stream

    async def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt,
                          params: SamplingParams | PoolingParams,
                          priority: int = 0) -> RequestStream:
        """`prepare`, then `add`."""
        return self.add(request_id, await self.prepare(prompt, params, priority))

    async def generate(self, request_id: str, prompt: PromptType | ProcessedPrompt,
                       params: SamplingParams | PoolingParams, priority: int = 0
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        stream = await self.add_request(request_id, prompt, params, priority)
        async for output in stream:
            yield output

    def abort_all(self) -> None:
        """Abort every request in flight; their streams end with finish_reason "abort"."""
        child_ids = tuple(self.output_processor.engine_request_ids)
        if child_ids:
            self.inbox.put(AbortRequests(child_ids))

    def abort(self, request_id: str) -> None:
        """Abort a user request (all its completions); unknown or finished ids are ignored."""
        self.streams.pop(request_id, None)
        if self.held_blocks is not None:
            self.held_blocks.release(request_id)
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids:
            self.inbox.put(AbortRequests(tuple(child_ids)))

    async def reset_prefix_cache(self) -> bool:
        self._check_alive()
        future: asyncio.Future[bool] = self._loop.create_future()
        self.inbox.put(ResetPrefixCache(
            lambda ok: self._loop.call_soon_threadsafe(future.set_result, ok)))
        return await future
