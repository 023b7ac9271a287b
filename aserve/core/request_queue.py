"""Waiting queues: the order in which waiting requests are admitted.

`FCFSQueue` admits by arrival; a preempted request goes back to the front so it resumes first.
`PriorityQueue` admits by `(priority, arrival_time)` (lower priority value first, ties in the
order they were added); a preempted request simply re-enters with its original key.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from aserve.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # O(n), only on abort

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A list kept sorted, the next to admit last:

        _entries  [(key of the last to admit, request), ..., (key of the next, request)]
        key       (-priority, -arrival_time, -n): n counts the requests added

    so `pop` is O(1), `add` and `remove` find their place by binary search (O(log n)
    comparisons, then one list shift), and iterating in admission order needs no sort."""

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[int, float, int], Request]] = []
        self._keys: dict[Request, tuple[int, float, int]] = {}
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (-request.priority, -request.arrival_time, -next(self._counter))
        self._keys[request] = key
        bisect.insort(self._entries, (key, request))  # keys are unique: requests never compared

    prepend = add  # a preempted request keeps its place by key

    def peek(self) -> Request:
        return self._entries[-1][1]

    def pop(self) -> Request:
        _, request = self._entries.pop()
        del self._keys[request]
        return request

    def remove(self, request: Request) -> None:
        key = self._keys.pop(request, None)
        if key is not None:
            del self._entries[bisect.bisect_left(self._entries, (key,))]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in reversed(self._entries))


def create_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
