"""The scheduler's collaborator for a KV connector (`core/kv_connector.py`): `RemoteKV` owns the
requests whose K/V the connector loads or has loaded, the finished requests whose blocks the
workers still use, and the connector's counters. `NoRemoteKV` stands in when no connector is
configured: no request has K/V to load, none is held, so `schedule()` never asks whether
there is a connector.

    waiting ─ num_loadable_tokens > 0 ─ start_load ─► waiting_for_remote_kvs
        ─ finished_recving ─► loaded ─ next_loaded, admitted before any waiting request ─► running
        └ failed_recving: blocks freed; back to waiting, computed here, never asked again
    finished, blocks still in use by the workers (sent to a peer; an abort while loading)
        ─ request_finished ─► held_for_workers ─ finished_sending / _recving / failed ─► freed

The scheduler owns `waiting` and `running`: a request crosses between them and these
collections only through arguments and return values (a loaded request is taken with `remove`
when admitted, or given back with `unload`; a failed load is returned by `update_from_output`
for the scheduler to queue again).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from aserve.core.kv_cache_coordinator import GroupBlocks
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from aserve.core.outputs import SchedulerOutput, SchedulerStats
from aserve.core.request import Request, RequestStatus


class RemoteKV:
    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # their blocks being loaded
        self.loaded: dict[str, Request] = {}  # loaded, waiting to run (holding their blocks)
        self.held_for_workers: dict[str, Request] = {}  # finished; blocks still in use
        self.num_held_blocks = 0  # the blocks of held_for_workers (every group, no null block)
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.num_kv_load_failures = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_seconds = 0.0

    # ------------------------------------------------------------------ the requests it holds

    @property
    def num_requests(self) -> int:
        """Unfinished requests here: loading or loaded."""
        return len(self.waiting_for_remote_kvs) + len(self.loaded)

    def request_ids(self) -> set[str]:
        return set(self.waiting_for_remote_kvs) | set(self.loaded)

    def has_held_blocks(self) -> bool:
        """Finished requests whose blocks the workers still send or load into."""
        return bool(self.held_for_workers)

    def has_blocks_in_use(self) -> bool:
        """Blocks that will come back without the scheduler: loads and held blocks."""
        return bool(self.waiting_for_remote_kvs or self.held_for_workers)

    def next_loaded(self) -> Request | None:
        """The loaded request to admit next (they go in the order their loads finished)."""
        return next(iter(self.loaded.values()), None)

    def remove(self, request: Request) -> bool:
        """Forget a loading or loaded request (admitted or aborted); whether it was here."""
        req_id = request.request_id
        return (self.waiting_for_remote_kvs.pop(req_id, None) is not None
                or self.loaded.pop(req_id, None) is not None)

    def unload(self, request: Request) -> None:
        """A loaded request that cannot grow while nothing runs gives its blocks back (they
        stay prefix hits), so that loaded requests never hold the cache between them; the
        scheduler queues it again as any waiting request."""
        del self.loaded[request.request_id]
        self.kv.free(request)
        request.num_computed_tokens = request.num_external_computed_tokens = 0

    # ------------------------------------------------------------------ loads

    def num_loadable_tokens(self, request: Request, num_cached: int) -> int:
        """Tokens past the local hit the connector can load (0: none, or not to be asked)."""
        if request.kv_load_failed or request.sampling_params.prompt_logprobs is not None:
            return 0
        num_external, load_async = self.connector.get_num_new_matched_tokens(request,
                                                                             num_cached)
        if num_external and not load_async:
            raise ValueError("the scheduler supports only asynchronous KV loads.")
        return num_external

    def start_load(self, request: Request, num_cached: int, cached_blocks: GroupBlocks,
                   num_external: int) -> bool:
        """Allocate the request's blocks (not cached until loaded) and let the workers load
        them: it waits here, WAITING_FOR_REMOTE_KVS. False, changing nothing, when blocks are
        short."""
        if self.kv.allocate_slots(request, 0, num_cached, cached_blocks,
                                  num_external_tokens=num_external) is None:
            return False
        self.external_prefix_cache_queries += request.num_tokens
        request.num_computed_tokens = num_cached
        request.num_external_computed_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_external)
        return True

    def give_up_load(self, request: Request) -> None:
        """A load that could never fit (nothing would free blocks): computed here instead,
        counted as a failed load."""
        request.kv_load_failed = True
        self.num_kv_load_failures += 1

    def register_local(self, request: Request) -> None:
        """`request` was allocated to compute its prompt here: the connector learns its
        blocks (it may save them)."""
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), 0)
        if not request.kv_load_failed and request.sampling_params.prompt_logprobs is None:
            self.external_prefix_cache_queries += request.num_tokens  # (asked: none)

    # ------------------------------------------------------------------ per step and request

    def request_finished(self, request: Request, loading: bool) -> tuple[bool, dict | None]:
        """`request` finished or was aborted (`loading`: while its K/V loaded). Whether its
        blocks stay allocated, held for the workers (loading into them, or the connector
        sends them), and the connector's `kv_transfer_params` for the client."""
        req_id = request.request_id
        delay_free, params = self.connector.request_finished(request,
                                                             self.kv.get_block_ids(req_id))
        if not (loading or delay_free):
            return False, params
        self.held_for_workers[req_id] = request
        self.num_held_blocks += self._num_blocks_of(req_id)
        return True, params

    def build_connector_meta(self, output: SchedulerOutput) -> Any:
        return self.connector.build_connector_meta(output)

    def update_from_output(self, kv_output: KVConnectorOutput | None) -> list[Request]:
        """Free what the workers are done with; loaded requests wait in `loaded`, their K/V
        computed but the last token's (the model must produce its logits). Returns the
        failed loads, to wait again at the front, computed from scratch."""
        if kv_output is None:
            return []
        self.kv_transfer_bytes += kv_output.num_bytes
        self.kv_transfer_seconds += kv_output.seconds
        done = kv_output.finished_sending | kv_output.finished_recving | kv_output.failed_recving
        for req_id in done:
            held = self.held_for_workers.pop(req_id, None)
            if held is not None:
                self.num_held_blocks -= self._num_blocks_of(req_id)
                self.kv.free(held)
        failed = []
        for req_id in sorted(kv_output.finished_recving | kv_output.failed_recving):
            request = self.waiting_for_remote_kvs.pop(req_id, None)
            if request is None:
                continue
            request.status = RequestStatus.WAITING
            if req_id in kv_output.failed_recving:
                self.kv.free(request)
                request.num_computed_tokens = request.num_external_computed_tokens = 0
                request.kv_load_failed = True
                self.num_kv_load_failures += 1
                failed.append(request)
                continue
            request.num_computed_tokens = min(
                request.num_computed_tokens + request.num_external_computed_tokens,
                request.num_tokens - 1)
            self.kv.cache_loaded_blocks(request, request.num_computed_tokens)
            self.external_prefix_cache_hits += request.num_external_computed_tokens
            self.loaded[req_id] = request
        return failed

    def add_stats(self, stats: SchedulerStats) -> SchedulerStats:
        return replace(
            stats,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            num_kv_load_failures=self.num_kv_load_failures,
            kv_transfer_bytes=self.kv_transfer_bytes,
            kv_transfer_seconds=self.kv_transfer_seconds,
            num_waiting_for_remote_kvs=len(self.waiting_for_remote_kvs),
            num_held_blocks=self.num_held_blocks)

    def check_invariants(self, live_request_ids: Collection[str]) -> None:
        kv = self.kv
        for request in self.loaded.values():
            assert request.status == RequestStatus.WAITING and request.num_external_computed_tokens
            assert kv.holds_blocks(request.request_id), f"loaded {request} holds no blocks"
        for request in self.waiting_for_remote_kvs.values():
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, request
            num_loaded = request.num_computed_tokens + request.num_external_computed_tokens
            for block_ids in kv.get_block_ids(request.request_id):
                assert len(block_ids) * kv.block_size >= num_loaded, request
        for req_id in self.held_for_workers:
            assert kv.holds_blocks(req_id), f"held {req_id} holds no blocks"
            assert req_id not in live_request_ids, f"held {req_id} runs"
        assert self.num_held_blocks == sum(map(self._num_blocks_of, self.held_for_workers))

    def _num_blocks_of(self, req_id: str) -> int:
        return sum(len(ids) - ids.count(0) for ids in self.kv.get_block_ids(req_id))


class NoRemoteKV:
    """`RemoteKV` without a connector: nothing to load, nothing held, nothing to count."""

    num_requests = 0

    def request_ids(self) -> set[str]:
        return set()

    def has_held_blocks(self) -> bool:
        return False

    def has_blocks_in_use(self) -> bool:
        return False

    def next_loaded(self) -> Request | None:
        return None

    def remove(self, request: Request) -> bool:
        return False

    def unload(self, request: Request) -> None:
        raise AssertionError("no request is loaded without a connector")

    def num_loadable_tokens(self, request: Request, num_cached: int) -> int:
        return 0

    def start_load(self, request: Request, num_cached: int, cached_blocks: GroupBlocks,
                   num_external: int) -> bool:
        raise AssertionError("no request loads without a connector")

    def give_up_load(self, request: Request) -> None:
        raise AssertionError("no request loads without a connector")

    def register_local(self, request: Request) -> None:
        pass

    def request_finished(self, request: Request, loading: bool) -> tuple[bool, dict | None]:
        return False, None

    def build_connector_meta(self, output: SchedulerOutput) -> Any:
        return None

    def update_from_output(self, kv_output: KVConnectorOutput | None) -> list[Request]:
        return []

    def add_stats(self, stats: SchedulerStats) -> SchedulerStats:
        return stats

    def check_invariants(self, live_request_ids: Collection[str]) -> None:
        pass


def make_remote_kv(connector: KVConnectorScheduler | None,
                   kv_cache_manager: KVCacheManager) -> RemoteKV | NoRemoteKV:
    return NoRemoteKV() if connector is None else RemoteKV(connector, kv_cache_manager)
