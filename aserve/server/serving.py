"""What the generation routes share: request parsing, validation before anything reaches the
engine, starting the engine requests, merging their streams, client-disconnect aborts, SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from aserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from aserve.engine.held_blocks import ServerBusyError
from aserve.engine.outputs import RequestOutput
from aserve.engine.processor import ContextLengthError, PreparedRequest, ProcessedPrompt
from aserve.sampling_params import SamplingParams
from aserve.server.errors import ErrorResponse, ServerError
from aserve.server.metrics import RequestTracker

ModelT = TypeVar("ModelT", bound=BaseModel)
logger = logging.getLogger(__name__)


def server_state(request: Request):
    return request.app.state.aserve


def running_engine(request: Request) -> AsyncEngine:
    engine = server_state(request).engine
    if engine is None or not engine.is_running:
        reason = engine.dead_error if engine is not None else None
        raise ServerError(reason or "The engine is not running.", 503)
    return engine


def check_model(request: Request, model: str | None) -> None:
    name = server_state(request).model_name
    if model is not None and model != name:
        raise ServerError(f"The model `{model}` does not exist.", 404, "model")


async def parse_body(request: Request, cls: type[ModelT]) -> ModelT:
    limit = server_state(request).config.max_request_body_bytes
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ServerError(f"The request body is larger than {limit} bytes.", 413,
                                  headers={"Connection": "close"})  # (the rest is not read)
    except ClientDisconnect:  # gone before its body arrived: nothing to answer, nothing to log
        raise ServerError("The client disconnected before sending its body.", 499) from None
    return cls.model_validate_json(bytes(body))  # ValidationError → 400 by its handler


async def process_prompt(engine: AsyncEngine, prompt: str | list[int],
                         add_special_tokens: bool, cache_salt: str | None = None,
                         param: str = "prompt") -> ProcessedPrompt:
    """Tokenized and checked; a 400 naming `param` (the request's field that holds the
    prompt) unless the message names a field of its own."""
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    try:
        return await engine.process_prompt({key: prompt, "cache_salt": cache_salt},
                                           add_special_tokens)
    except ValueError as e:
        error = ServerError.from_value_error(e)
        error.param = param if error.param in (None, "prompt") else error.param
        raise error from e


def sampling_params_of(body) -> SamplingParams:
    """The request's `SamplingParams` as its fields say (max_tokens None where the client gave
    none: the engine fills in what the context leaves); a 400 naming the field they refuse."""
    try:
        return body.to_sampling_params()
    except ValueError as e:
        raise ServerError.from_value_error(e) from e


async def prepare(engine: AsyncEngine, prompt: ProcessedPrompt, params: SamplingParams,
                  body, param: str = "prompt") -> PreparedRequest:
    """Checked against the model and its context, the constraint compiled (the engine's
    processor), before the engine sees anything: a 400 naming the field (a prompt that does
    not fit its context: `param`, the request's field holding it; a constraint: the field of
    `body` that carried it, `StructuredOutputFields.naming_the_field`)."""
    try:
        return await engine.prepare(prompt, params, body.priority)
    except ContextLengthError as e:
        raise ServerError(str(e), 400, e.param or param) from e
    except ValueError as e:
        error = ServerError.from_value_error(e)
        error.message, error.param = body.naming_the_field(error.message, error.param)
        raise error from e
    except EngineDeadError as e:
        raise ServerError(str(e), 503) from e


RETRY_AFTER_S = 1  # what an overloaded server tells clients to wait, in seconds


@dataclass
class Generation:
    """One engine request (one prompt, `n` completions) of an HTTP request."""

    prompt: ProcessedPrompt
    params: SamplingParams
    stream: RequestStream
    tracker: RequestTracker
    deadline: float | None = None  # time.monotonic() by which it must finish


def check_capacity(request: Request, engine: AsyncEngine, num_new: int) -> None:
    """Refuse at once (503 + Retry-After) what would wait beyond `max_waiting_requests`: in
    flight, at most `max_num_seqs` run and the rest wait."""
    state = server_state(request)
    limit = state.engine_args.max_num_seqs + state.config.max_waiting_requests
    if num_new > limit:  # no retry could ever succeed
        raise ServerError(f"The request asks for {num_new} completions (prompts × n), more "
                          f"than the server ever admits at once ({limit}).", 400, "n")
    if engine.num_requests_in_flight + num_new > limit:
        state.metrics.on_rejected()
        raise ServerError(
            f"The server is overloaded: {engine.num_requests_in_flight} requests in flight "
            f"(at most {state.engine_args.max_num_seqs} running and "
            f"{state.config.max_waiting_requests} waiting). Retry later.", 503,
            headers={"Retry-After": str(RETRY_AFTER_S)})


def start_generations(request: Request, engine: AsyncEngine, request_id: str,
                      prepared: list[PreparedRequest]) -> list[Generation]:
    """Hand every prepared prompt of one HTTP request to the engine (all were checked first,
    so a bad one added nothing)."""
    state = server_state(request)
    check_capacity(request, engine, sum(p.params.n for p in prepared))
    timeout = state.config.request_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    generations: list[Generation] = []
    try:
        for i, p in enumerate(prepared):
            rid = request_id if len(prepared) == 1 else f"{request_id}-{i}"
            stream = engine.add(rid, p)
            generations.append(Generation(p.prompt, p.params, stream,
                                          state.metrics.track(len(p.prompt.prompt_token_ids)),
                                          deadline))
    except ValueError as e:
        abort_all(generations)
        raise ServerError.from_value_error(e) from e
    except EngineDeadError as e:
        abort_all(generations)
        raise ServerError(str(e), 503) from e
    except ServerBusyError as e:
        abort_all(generations)
        state.metrics.on_rejected()
        raise ServerError(str(e), 503, headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    return generations


def abort_all(generations: list[Generation]) -> None:
    for generation in generations:
        generation.stream.abort()


async def merged_outputs(generations: list[Generation]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(generation index, delta) as they arrive from every generation; aborts all on exit."""
    # Bounded: a pump waits while the reader is behind, and what its stream receives meanwhile
    # waits there, merged past 64 (`RequestStream.put`): a slow reader costs its text, not a
    # queue a step.
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(
        maxsize=max(1, len(generations)))

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g.stream)) for i, g in enumerate(generations)]
    remaining = len(tasks)
    deadline = generations[0].deadline if generations else None
    try:
        while remaining:
            i, item = await _next(queue, deadline)
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                record(generations[i].tracker, item)
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        abort_all(generations)


async def _next(queue: asyncio.Queue, deadline: float | None):
    """The queue's next item; a 504 `ServerError` once `deadline` has passed."""
    if deadline is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise ServerError("The request did not finish within the server's request timeout; "
                          "it was aborted.", 504) from None


def record(tracker: RequestTracker, output: RequestOutput) -> None:
    for delta in output.outputs:
        tracker.on_tokens(len(delta.token_ids))
        if delta.finish_reason is not None:
            tracker.on_finish(delta.finish_reason)


async def until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_or_abort(request: Request, generations: list[Generation]
                           ) -> list[list[RequestOutput]]:
    """Every delta of every generation; if the client disconnects first, abort them all."""
    results: list[list[RequestOutput]] = [[] for _ in generations]

    async def collect() -> None:
        async for i, output in merged_outputs(generations):
            results[i].append(output)

    collector = asyncio.create_task(collect())
    watcher = asyncio.create_task(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector not in done:
            collector.cancel()
            abort_all(generations)
            raise ServerError("The client disconnected.", 499)
        collector.result()  # re-raises an engine failure
    except EngineDeadError as e:
        raise ServerError(str(e), 503) from e
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return results


DONE = "data: [DONE]\n\n"


def event_stream(request: Request, chunks: AsyncIterator[BaseModel],
                 generations: list[Generation]) -> EventStream:
    return EventStream(sse_events(chunks), generations,
                       server_state(request).config.stream_stall_timeout)


class EventStream(StreamingResponse):
    """A server-sent-event response whose client must keep reading. A write waits only while
    the connection's buffers are full (the client reads nothing); one that waits longer than
    `stall_timeout` seconds aborts the generations, so their running slots and KV blocks come
    back, and the connection is closed. (Before, 4 such streams of n=64 held all 256 slots
    until they had generated everything.)"""

    def __init__(self, body: AsyncIterator[str], generations: list[Generation],
                 stall_timeout: float | None) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.generations, self.stall_timeout = generations, stall_timeout

    async def stream_response(self, send) -> None:
        if not self.stall_timeout:
            return await super().stream_response(send)
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        stalled = False

        def give_up() -> None:
            nonlocal stalled
            stalled = True
            task.cancel()

        async def send_or_give_up(message) -> None:
            # a timer per write rather than wait_for, which makes a task per call
            # (docs/benchmarks/before-after.md, "Hostile-input hardening")
            timer = loop.call_later(self.stall_timeout, give_up)
            try:
                await send(message)
            finally:
                timer.cancel()

        try:
            await super().stream_response(send_or_give_up)
        except asyncio.CancelledError:
            if not stalled:
                raise
            abort_all(self.generations)
            logger.warning("A stream's client read nothing for %g s: its request is aborted "
                           "and the connection closed", self.stall_timeout)


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """A server-sent-event body: each chunk as `data: {...}`; a failure after the stream has
    started is reported in-band (the status is already sent); then `data: [DONE]`."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as e:  # noqa: BLE001 - reported to the client in the stream
        yield sse_error(e)
    yield DONE


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def sse_error(error: Exception) -> str:
    if isinstance(error, ServerError):
        return sse(ErrorResponse.of(error.message, error.status, error.param))
    status = 503 if isinstance(error, EngineDeadError) else 500
    return sse(ErrorResponse.of(str(error), status))
