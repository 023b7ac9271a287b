"""Waiting queues: FCFS and priority order, prepend after preemption, removal on abort."""

from __future__ import annotations

import pytest
from helpers.requests import make_request

from aserve.core.request import Request
from aserve.core.request_queue import FCFSQueue, PriorityQueue, create_request_queue


def ids(queue: FCFSQueue | PriorityQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: FCFSQueue | PriorityQueue) -> list[str]:
    order = []
    while len(queue):
        assert queue.peek() is queue.peek()
        head = queue.peek()
        assert queue.pop() is head
        order.append(head.request_id)
    return order


def test_create_request_queue_picks_the_policy() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSQueue)
    assert isinstance(create_request_queue("priority"), PriorityQueue)


def test_fcfs_pops_in_insertion_order_ignoring_priority_and_arrival() -> None:
    queue = FCFSQueue()
    for req_id, arrival, priority in [("a", 2.0, 5), ("b", 1.0, 0), ("c", 3.0, -1)]:
        queue.add(make_request(req_id, arrival=arrival, priority=priority))
    assert ids(queue) == ["a", "b", "c"]
    assert len(queue) == 3
    assert drain(queue) == ["a", "b", "c"]
    assert len(queue) == 0


def test_fcfs_prepend_puts_a_preempted_request_first() -> None:
    queue = FCFSQueue()
    for req_id in "abc":
        queue.add(make_request(req_id, arrival=0.0))
    queue.prepend(make_request("late", arrival=9.0))
    assert ids(queue) == ["late", "a", "b", "c"]
    queue.prepend(make_request("early", arrival=0.5))  # preempted second; arrived first, so first
    assert drain(queue) == ["early", "late", "a", "b", "c"]


def test_fcfs_remove_takes_out_exactly_that_request() -> None:
    queue = FCFSQueue()
    requests = [make_request(req_id, arrival=0.0) for req_id in "abcd"]
    for request in requests:
        queue.add(request)
    queue.remove(requests[2])
    queue.remove(requests[0])
    assert ids(queue) == ["b", "d"]
    with pytest.raises(ValueError):
        queue.remove(requests[0])


def test_priority_pops_lowest_value_first_then_earliest_arrival() -> None:
    queue = PriorityQueue()
    specs = [("p2", 0.0, 2), ("p0-late", 5.0, 0), ("p1", 1.0, 1), ("p0-early", 3.0, 0),
             ("neg", 9.0, -3)]
    for req_id, arrival, priority in specs:
        queue.add(make_request(req_id, arrival=arrival, priority=priority))
    expected = ["neg", "p0-early", "p0-late", "p1", "p2"]
    assert ids(queue) == expected  # iteration shows admission order without popping
    assert queue.peek().request_id == "neg"
    assert drain(queue) == expected


def test_priority_ties_on_key_keep_insertion_order() -> None:
    queue = PriorityQueue()
    for req_id in "abcde":
        queue.add(make_request(req_id, arrival=1.0, priority=1))
    assert drain(queue) == list("abcde")


def test_priority_prepend_reenters_by_key_not_at_the_front() -> None:
    queue = PriorityQueue()
    queue.add(make_request("urgent", arrival=5.0, priority=0))
    queue.add(make_request("later", arrival=7.0, priority=2))
    queue.prepend(make_request("preempted", arrival=1.0, priority=1))
    assert drain(queue) == ["urgent", "preempted", "later"]


def test_priority_remove_keeps_heap_order() -> None:
    queue = PriorityQueue()
    requests = [make_request(f"r{i}", arrival=float(i), priority=(7 * i) % 5) for i in range(10)]
    for request in requests:
        queue.add(request)
    for index in (0, 3, 9, 4):
        queue.remove(requests[index])
    kept = sorted((r for i, r in enumerate(requests) if i not in (0, 3, 9, 4)),
                  key=Request.sort_key)
    assert len(queue) == 6
    assert drain(queue) == [r.request_id for r in kept]
