"""The scheduler's invariants between steps (docs/design.md §10), asserted by
`Scheduler.check_invariants` (the tests' fake runner calls it after every step): the request
table, the queues and the KV cache agree, and no request claims more than it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aserve.core.kv_cache_utils import max_blocks_per_request
from aserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from aserve.core.scheduler import Scheduler


def check_scheduler(scheduler: Scheduler) -> None:
    kv, config = scheduler.kv_cache_manager, scheduler.config
    kv.check_invariants()
    scheduler.remote_kv.check_invariants(scheduler.requests)
    running_ids = {r.request_id for r in scheduler.running}
    waiting_ids = {r.request_id for r in scheduler.waiting}
    remote_ids = scheduler.remote_kv.request_ids()
    assert len(running_ids) == len(scheduler.running), "a request is running twice"
    assert not running_ids & waiting_ids, "a request is both running and waiting"
    assert not (running_ids | waiting_ids) & remote_ids, "a loading request is queued"
    assert running_ids | waiting_ids | remote_ids == set(scheduler.requests), (
        "request table out of sync")
    assert len(scheduler.running) <= config.max_num_seqs, "too many running requests"
    if config.policy == "priority":
        keys = [r.sort_key() for r in scheduler.running]
        assert keys == sorted(keys), "running is out of preemption order"
    for request in scheduler.running:
        _check_running(scheduler, request)
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
        assert not kv.holds_blocks(request.request_id), f"waiting {request} holds blocks"
        assert request.num_output_placeholders == 0, request
        assert request.num_slot_tokens == request.num_covered_tokens == 0, request
    output = scheduler._last_output
    if output is not None:
        assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.num_scheduled_tokens) <= config.max_num_seqs


def _check_running(scheduler: Scheduler, request: Request) -> None:
    kv, config = scheduler.kv_cache_manager, scheduler.config
    assert request.status == RequestStatus.RUNNING, request
    room = None  # the tokens the request's blocks have room for, in every group
    for group_id, block_ids in enumerate(kv.get_block_ids(request.request_id)):
        covered = len(block_ids) * scheduler.block_size
        room = covered if room is None else min(room, covered)
        assert request.num_computed_tokens <= covered, (
            f"group {group_id}'s blocks do not cover {request}")
        max_blocks = max_blocks_per_request(kv.groups[group_id], config.max_model_len,
                                            config.max_num_batched_tokens
                                            + scheduler.spec.num_lookahead)
        num_held = sum(1 for block_id in block_ids if block_id != 0)
        assert num_held <= max_blocks, f"{request} holds {num_held} blocks of group {group_id}"
    # the bounds a decode is scheduled by without a call never claim more than is there
    assert request.num_covered_tokens <= request.num_slot_tokens <= (room or 0), (
        f"{request}: bounds {request.num_covered_tokens} / {request.num_slot_tokens} past "
        f"its blocks' room {room}")
    assert request.num_computed_tokens <= (request.num_tokens + request.num_output_placeholders
                                           + len(request.spec_token_ids)), request
    assert request.num_output_placeholders <= 2 * config.async_scheduling, request
