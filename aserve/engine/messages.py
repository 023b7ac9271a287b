"""Mailbox messages between the event loop and the engine thread (frozen dataclasses).

    event loop ──inbox: queue.SimpleQueue[Command]──► engine thread
    event loop ◄──loop.call_soon_threadsafe(EngineMessage)── engine thread

The two sides share nothing else — an abort is a message, not a flag — but the `StepLog` that
`EngineReady` hands over: the engine thread appends to it, the loop copies it, under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aserve.config import ModelInfo
from aserve.core.outputs import SchedulerStats, StepOutputs
from aserve.core.request import Request
from aserve.engine.step_log import StepLog

# ---------------------------------------------------------------- commands (to the engine)


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class ResetPrefixCache:
    reply: Callable[[bool], None]  # called in the engine thread with the result


@dataclass(frozen=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequests | ResetPrefixCache | Shutdown

# ---------------------------------------------------------------- messages (from the engine)


@dataclass(frozen=True)
class EngineReady:
    model_info: ModelInfo
    num_kv_blocks: int
    step_log: StepLog


@dataclass(frozen=True)
class EngineCoreOutputs:
    outputs: StepOutputs  # a step's, aborted requests' first
    stats: SchedulerStats


@dataclass(frozen=True)
class EngineDead:
    """The engine thread failed (or could not start); every in-flight request must fail."""

    error: str


EngineMessage = EngineReady | EngineCoreOutputs | EngineDead
