"""`StepLog`: what the last few hundred engine steps were made of, for the dashboard.

The engine thread appends one tuple per step; the event loop copies the lot when a dashboard
polls. It is the one object both sides touch outside the mailboxes (`messages.py`), and it is
built for that: a bounded deque behind a lock held only for an append or a copy, so a step
pays one tuple and one append. (Under the GIL a deque's copy happens not to interleave with an
append; the lock makes that a guarantee, free-threaded builds included, at a cost that is
nothing beside a step.)
"""

from __future__ import annotations

import threading
import time
from collections import deque

STEP_LOG_CAPACITY = 256

# (time.monotonic() at the step's end, prefill tokens, decode tokens, the model's seconds)
StepRecord = tuple[float, int, int, float]


class StepLog:
    def __init__(self, capacity: int = STEP_LOG_CAPACITY) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def record(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float) -> None:
        """Called by the engine thread after each step that computed tokens."""
        with self._lock:
            self._steps.append((time.monotonic(), num_prefill_tokens, num_decode_tokens, seconds))

    def snapshot(self) -> list[StepRecord]:
        """The recorded steps, oldest first; safe from any thread."""
        with self._lock:
            return list(self._steps)
