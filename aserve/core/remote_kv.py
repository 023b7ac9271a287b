"""The scheduler's part of a KV connector (`core/kv_connector.py`), as a mixin of `Scheduler`:
asking the connector, starting loads, taking the workers' reports, admitting loaded requests.

    waiting ─ connector has tokens ─► waiting_for_remote_kvs ─ finished_recving ─► loaded ─► running
                                              └─ failed_recving: blocks freed, back to waiting
    finished, blocks still in use by the workers (sent to a peer, an abort while loading)
        ─► held_for_workers ─ finished_sending / finished_recving / failed_recving ─► freed

The state lives on the `Scheduler` (`connector`, `waiting_for_remote_kvs`, `loaded`,
`held_for_workers` and the counters); this class only groups the methods that use it.
"""

from __future__ import annotations

from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.request import Request, RequestStatus
from aserve.core.step_cost import StepBudget


class RemoteKVScheduling:
    def _admit_loaded(self, budget: StepBudget, num_scheduled: dict[str, int],
                      admitted: list[Request]) -> None:
        """Requests whose K/V a connector loaded go first: they hold their blocks already.
        One that cannot grow while nothing runs (nothing would free a block) gives its blocks
        back — they stay prefix hits — and waits as any request, so that loaded requests
        never hold the cache between them."""
        kv = self.kv_cache_manager
        while (self.loaded and budget.num_tokens > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.loaded[0]
            num_computed = request.num_computed_tokens
            num_new = self._num_tokens_to_schedule(request, num_computed, budget)
            if num_new <= 0:
                return
            if kv.allocate_slots(request, num_new) is None:
                if self.running:
                    return
                del self.loaded[0]
                kv.free(request)
                request.num_computed_tokens = request.num_external_computed_tokens = 0
                self.waiting.prepend(request)
                continue
            del self.loaded[0]
            self._admit(request, num_computed, num_new, budget, num_scheduled, admitted)

    def _num_external_tokens(self, request: Request, num_cached: int) -> int:
        """Tokens past the local hit the connector can load (0: none, or not to be asked)."""
        if (self.connector is None or request.kv_load_failed
                or request.sampling_params.prompt_logprobs is not None):
            return 0
        num_external, load_async = self.connector.get_num_new_matched_tokens(request,
                                                                             num_cached)
        if num_external and not load_async:
            raise ValueError("the scheduler supports only asynchronous KV loads.")
        return num_external

    def _start_remote_load(self, request: Request, num_cached: int, cached_blocks,
                           num_external: int) -> bool:
        """Allocate the request's blocks and let the workers load them; False (nothing
        changed) when blocks are short. When nothing could ever free blocks, the request
        gives the load up and is computed here instead (counted as a failed load)."""
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, 0, num_cached, cached_blocks,
                             num_external_tokens=num_external) is None:
            if self.running or self.waiting_for_remote_kvs or self.held_for_workers:
                return False
            request.kv_load_failed = True
            self.num_kv_load_failures += 1
            return True  # peeked again: admitted as a local computation
        self.waiting.pop()
        self.external_prefix_cache_queries += request.num_tokens
        request.num_computed_tokens = num_cached
        request.num_external_computed_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self.connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id),
                                                num_external)
        return True

    def _update_from_kv_output(self, kv_output: KVConnectorOutput) -> None:
        """Free what the workers are done with; loaded requests wait to run (`loaded`, ahead
        of `waiting`), their K/V computed but the last token's (the model must produce its
        logits); failed ones wait again, at the front, to be computed from scratch."""
        self.kv_transfer_bytes += kv_output.num_bytes
        self.kv_transfer_seconds += kv_output.seconds
        done = kv_output.finished_sending | kv_output.finished_recving | kv_output.failed_recving
        for req_id in done:
            held = self.held_for_workers.pop(req_id, None)
            if held is not None:
                self.num_held_blocks -= self._num_blocks_of(req_id)
                self.kv_cache_manager.free(held)
        for req_id in sorted(kv_output.finished_recving | kv_output.failed_recving):
            request = self.waiting_for_remote_kvs.pop(req_id, None)
            if request is None:
                continue
            request.status = RequestStatus.WAITING
            if req_id in kv_output.failed_recving:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = request.num_external_computed_tokens = 0
                request.kv_load_failed = True
                self.num_kv_load_failures += 1
                self.waiting.prepend(request)
                continue
            request.num_computed_tokens = min(
                request.num_computed_tokens + request.num_external_computed_tokens,
                request.num_tokens - 1)
            self.kv_cache_manager.cache_loaded_blocks(request, request.num_computed_tokens)
            self.external_prefix_cache_hits += request.num_external_computed_tokens
            self.loaded.append(request)
