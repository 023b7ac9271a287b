"""The scheduler with a KV connector (`core/kv_connector.py`): asynchronous loads, aborts while
loading, preemption after a load, delayed frees, failed loads, hybrid groups.

A `FakeConnector` plays both sides: its scheduler side offers `offers[req_id]` tokens once per
request; its worker side (the `FakeRunner`'s `kv_worker`) loads what the step's metadata asks
for `load_steps` steps later (writing the request's own tokens into its blocks, so that the
runner's read checks pass only if the scheduler computed exactly the rest), fails the loads
of `failing` requests, and reports blocks held for a peer (`delay_free`) sent once `release`
names them. `FakeRunner` checks every invariant after each step. Block size 4; the fake model
samples `100 + position`, never EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.fake_runner import FakeRunner, hybrid_cache_config
from helpers.requests import make_request

from aserve.config import CacheConfig, SchedulerConfig
from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler

BS = 4


def counting(req_id: str, position: int) -> int:
    return 100 + position


@dataclass
class FakeConnector:
    offers: dict[str, int] = field(default_factory=dict)  # req id → tokens it can load
    load_steps: int = 0  # steps after the metadata before a load completes
    failing: set[str] = field(default_factory=set)
    delay_free: set[str] = field(default_factory=set)
    release: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)
    allocated: dict[str, tuple[tuple[list[int], ...], int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    _starts: list[tuple[str, int, int]] = field(default_factory=list)
    _loading: list[list] = field(default_factory=list)  # [req id, start, end, steps left]
    _held: set[str] = field(default_factory=set)

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed: int):
        self.asked.append(request.request_id)
        return max(0, self.offers.pop(request.request_id, 0) - num_computed), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (block_ids, num_external_tokens)
        if num_external_tokens:
            start = request.num_computed_tokens
            self._starts.append((request.request_id, start, start + num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        starts, self._starts = self._starts, []
        return starts

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        if request.request_id in self.delay_free:
            self._held.add(request.request_id)
            return True, {"handle": request.request_id}
        return False, None

    # worker side
    def worker(self, runner: FakeRunner, output) -> KVConnectorOutput:
        self._loading += [[req_id, start, end, self.load_steps]
                          for req_id, start, end in output.kv_connector_metadata]
        result = KVConnectorOutput()
        for entry in list(self._loading):
            req_id, start, end, steps = entry
            if steps > 0:
                entry[3] -= 1
                continue
            self._loading.remove(entry)
            if req_id in self.failing:
                result.failed_recving.add(req_id)
                continue
            if req_id in runner.scheduler.requests:  # (not aborted meanwhile)
                runner.load_kv(req_id, start, end)
            result.finished_recving.add(req_id)
            result.num_bytes += (end - start) * 10
        result.finished_sending = self._held & self.release
        self._held -= result.finished_sending
        return result


def make_scheduler(connector: FakeConnector, num_blocks: int = 64, *,
                   cache_config: CacheConfig | None = None, async_scheduling: bool = False,
                   policy: str = "fcfs") -> Scheduler:
    cache_config = cache_config or CacheConfig(block_size=BS, num_blocks=num_blocks + 1)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=64, async_scheduling=async_scheduling,
                                     policy=policy), cache_config, connector)


def start(scheduler: Scheduler, connector: FakeConnector, *requests: Request) -> FakeRunner:
    for request in requests:
        scheduler.add_request(request)
    return FakeRunner(scheduler, counting, kv_worker=connector.worker)


def start_loading(max_tokens: int = 3, **connector_kwargs
                  ) -> tuple[FakeConnector, Scheduler, FakeRunner]:
    """Request "r" (a 10-token prompt) on a scheduler whose connector offers 8 tokens of it
    (unless `offers` says otherwise), after its first step: its load has started."""
    connector = FakeConnector(**{"offers": {"r": 8}, **connector_kwargs})
    scheduler = make_scheduler(connector)
    runner = start(scheduler, connector, make_request("r", list(range(10)),
                                                      max_tokens=max_tokens))
    runner.step()
    return connector, scheduler, runner


def assert_all_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not scheduler.has_kv_transfers() and not scheduler.remote_kv.waiting_for_remote_kvs


def expected(prompt_len: int, num_new: int) -> list[int]:
    return [100 + p for p in range(prompt_len, prompt_len + num_new)]


def test_async_load_waits_then_runs_computing_only_the_tail() -> None:
    connector = FakeConnector(offers={"r": 8}, load_steps=1)
    scheduler = make_scheduler(connector)
    runner = start(scheduler, connector, make_request("r", list(range(10)), max_tokens=3))
    output, _ = runner.step()  # blocks allocated, the load starts: nothing scheduled
    assert output.is_empty and output.kv_connector_metadata == [("r", 0, 8)]
    assert scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.allocated["r"][1] == 8 and len(connector.allocated["r"][0][0]) == 2
    output, _ = runner.step()  # still loading
    assert output.is_empty
    output, _ = runner.step()  # loaded in the last step: only the tail is computed
    assert output.num_scheduled_tokens == {"r": 2}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 8
    runner.run_until_done()
    assert runner.streamed["r"] == expected(10, 3)
    stats = scheduler.make_stats()
    assert (stats.external_prefix_cache_hits, stats.external_prefix_cache_queries) == (8, 10)
    assert stats.kv_transfer_bytes == 80 and stats.num_kv_load_failures == 0
    assert_all_free(scheduler)


def test_a_whole_prompt_loaded_recomputes_its_last_token() -> None:
    connector = FakeConnector(offers={"r": 10})
    scheduler = make_scheduler(connector, async_scheduling=True)
    runner = start(scheduler, connector, make_request("r", list(range(10)), max_tokens=3))
    runner.step()
    output, _ = runner.step()  # (async: the load's report is read only after this schedule)
    assert output.is_empty
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"r": 1}  # position 9: it produces the logits
    runner.run_until_done()
    assert runner.streamed["r"] == expected(10, 3)
    assert_all_free(scheduler)


def test_loaded_blocks_enter_the_prefix_cache_only_once_loaded() -> None:
    _, scheduler, runner = start_loading(max_tokens=2, load_steps=2)
    scheduler.add_request(make_request("b", list(range(10)), max_tokens=2))
    output, _ = runner.step()  # r still loading: b finds no hit in r's blocks, computes all
    assert output.num_scheduled_tokens == {"b": 10}
    runner.run_until_done()
    scheduler.add_request(make_request("c", list(range(10)), max_tokens=2))
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"c": 2}  # 8 tokens hit (r's or b's blocks)
    runner.run_until_done()
    assert runner.streamed["r"] == runner.streamed["b"] == runner.streamed["c"] == expected(10, 2)
    assert_all_free(scheduler)


def test_abort_while_loading_holds_the_blocks_until_the_workers_are_done() -> None:
    connector, scheduler, runner = start_loading(load_steps=2)
    (aborted,) = scheduler.finish_requests(["r"])
    assert aborted.status == RequestStatus.FINISHED_ABORTED and "r" in connector.finished
    assert not scheduler.has_unfinished_requests() and scheduler.has_kv_transfers()
    assert scheduler.kv_cache_manager.usage > 0  # the workers still write into them
    for _ in range(3):
        output, _ = runner.step()
        assert "r" not in output.num_scheduled_tokens
    assert "r" not in runner.streamed
    assert_all_free(scheduler)


def test_a_failed_load_is_recomputed_and_counted() -> None:
    connector, scheduler, runner = start_loading(failing={"r"})
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"r": 10}  # from scratch
    runner.run_until_done()
    assert runner.streamed["r"] == expected(10, 3)
    assert connector.asked == ["r"]  # not asked again after the failure
    stats = scheduler.make_stats()
    assert stats.num_kv_load_failures == 1 and stats.external_prefix_cache_hits == 0
    assert_all_free(scheduler)


def test_preemption_after_a_load_recomputes_the_request() -> None:
    # 6 usable blocks; a (priority 1, 16-token prompt, 12 loaded) runs, then b (priority 0)
    # arrives: when blocks run out, a is the victim, and starts over without a second load
    connector = FakeConnector(offers={"a": 12})
    scheduler = make_scheduler(connector, num_blocks=6, policy="priority")
    a = make_request("a", list(range(16)), max_tokens=6, priority=1)
    runner = start(scheduler, connector, a)
    runner.step()
    runner.step()
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 16
    scheduler.add_request(make_request("b", list(range(50, 54)), max_tokens=6))
    runner.run_until_done()
    assert a.num_preemptions == 1
    assert runner.streamed["a"] == expected(16, 6) and runner.streamed["b"] == expected(4, 6)
    assert scheduler.make_stats().external_prefix_cache_hits == 12
    assert_all_free(scheduler)


def test_delayed_free_holds_blocks_until_sent_and_returns_the_params() -> None:
    connector = FakeConnector(delay_free={"r"})
    scheduler = make_scheduler(connector)
    runner = start(scheduler, connector, make_request("r", list(range(10)), max_tokens=1))
    _, outputs = runner.step()
    (out,) = outputs
    assert out.finished and out.kv_transfer_params == {"handle": "r"}
    assert not scheduler.has_unfinished_requests() and scheduler.has_kv_transfers()
    held = scheduler.kv_cache_manager.get_block_ids("r")
    assert held == ([1, 2, 3],)
    runner.step()
    runner.step()
    assert scheduler.has_kv_transfers()  # not sent yet: still held
    connector.release.add("r")
    runner.step()
    assert_all_free(scheduler)


def test_hybrid_groups_load_per_group_blocks_and_null_the_skipped_ones() -> None:
    connector = FakeConnector(offers={"r": 16})
    cache_config = hybrid_cache_config([None, 6], block_size=BS, num_blocks=65)
    scheduler = make_scheduler(connector, cache_config=cache_config)
    runner = start(scheduler, connector, make_request("r", list(range(18)), max_tokens=5))
    runner.step()
    block_ids, num_external = connector.allocated["r"]
    assert num_external == 16 and [len(ids) for ids in block_ids] == [4, 4]
    assert set(block_ids[0]).isdisjoint(block_ids[1])
    output, _ = runner.step()
    assert output.num_scheduled_tokens == {"r": 2}
    (new,) = output.scheduled_new_reqs
    # group 1 (W = 6) reads positions >= 16 - 6 + 1 = 11 from now on: blocks 0 and 1 nulled
    assert new.block_ids[1][:2] == [0, 0] and 0 not in new.block_ids[0]
    runner.run_until_done()
    assert runner.streamed["r"] == expected(18, 5)
    assert_all_free(scheduler)


def test_a_load_that_can_never_fit_is_computed_here_instead() -> None:
    # 4 usable blocks, a sliding window of 4: a 30-token prompt runs in chunks, but loading
    # it whole would need 8 blocks per group at once
    connector = FakeConnector(offers={"r": 28})
    cache_config = hybrid_cache_config([4], block_size=BS, num_blocks=5)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8,
                                          max_model_len=64), cache_config, connector)
    runner = start(scheduler, connector, make_request("r", list(range(30)), max_tokens=3))
    runner.run_until_done()
    assert runner.streamed["r"] == expected(30, 3)
    assert scheduler.make_stats().num_kv_load_failures == 1
    assert_all_free(scheduler)
