"""The runner's persistent block tables (`runner/block_table.py`) give, every step, exactly the
tables that rebuilding them from each request's block-id lists gives: over random schedules of
the real scheduler (full, sliding and hybrid groups, chunked prefill, prefix hits, preemption
and resumption, aborts, async scheduling), starting from a one-row, one-column table that has
to grow."""

from __future__ import annotations

import random

import numpy as np
from helpers.fake_runner import FakeRunner, hybrid_cache_config

from aserve.config import PrefillPolicy, SchedulerConfig
from aserve.core.kv_cache_utils import blocks_per_request
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.runner.block_table import BlockTables
from aserve.sampling_params import SamplingParams


def rebuilt(block_ids: list[list[int]]) -> np.ndarray:
    """What the runner built every step before: [num_reqs, longest] int32, zero-padded."""
    table = np.zeros((len(block_ids), max(map(len, block_ids))), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, :len(ids)] = ids
    return table


def test_rows_are_appended_to_freed_zeroed_and_reused_and_gathered_in_batch_order():
    tables = BlockTables(num_groups=2, num_rows=1, num_cols=1)
    tables.add("a", ([1, 2], [0, 3]))
    tables.add("b", ([4], [5]))  # a second row: the table grows
    tables.append("a", ([6], []))
    full, sliding = tables.gather(["b", "a"])
    assert full.tolist() == [[4, 0, 0], [1, 2, 6]] and full.dtype == np.int32
    assert sliding.tolist() == [[5, 0], [0, 3]]
    tables.remove("a")
    tables.add("c", ([7], [8]))  # takes a's row, zeroed
    assert tables.rows["c"] == 0 and [t.tolist() for t in tables.gather(["c"])] == [[[7]], [[8]]]
    tables.check_invariants()


def test_a_request_sent_whole_again_replaces_its_row():
    tables = BlockTables(num_groups=1)
    tables.add("a", ([1, 2, 3],))
    tables.add("a", ([9],))  # (resumed after preemption, its old row never forgotten)
    assert tables.gather(["a"])[0].tolist() == [[9]] and len(tables.rows) == 1
    tables.check_invariants()


class CheckingRunner(FakeRunner):
    """`FakeRunner` keeps each request's block ids as lists, appended from the diffs as the
    runner's used to be; each step the persistent tables must gather to the rebuilt ones."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.tables = BlockTables(len(self.windows), num_rows=1, num_cols=1)
        self.num_compared = self.num_null_ids = 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(output)  # (its lists updated from `output`)
        self.tables.update(output)
        self.tables.check_invariants()
        assert set(self.tables.rows) == set(self.states)
        req_ids = list(output.num_scheduled_tokens)
        if req_ids:
            for group, table in enumerate(self.tables.gather(req_ids)):
                lists = [self.states[r].block_ids[group] for r in req_ids]
                want = rebuilt(lists)
                assert table.dtype == want.dtype and np.array_equal(table, want), group
                self.num_null_ids += sum(ids.count(0) for ids in lists)  # (a sliding hit's)
            self.num_compared += 1
        return result


def random_run(rng: random.Random) -> tuple[CheckingRunner, Scheduler]:
    block_size, max_model_len, budget = rng.choice([1, 2, 4]), 40, rng.randrange(2, 24)
    windows = rng.choice([[None], [None, rng.randrange(1, 10)], [rng.randrange(1, 8)] * 2,
                          [None, rng.randrange(1, 6), None, rng.randrange(4, 12)]])
    probe = hybrid_cache_config(windows, block_size=block_size, num_blocks=2)
    num_blocks = blocks_per_request(probe.groups, max_model_len, budget) + 1 + rng.randrange(4)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=rng.randrange(1, 7), max_num_batched_tokens=budget,
                        max_model_len=max_model_len,
                        prefill=PrefillPolicy(
                            long_prefill_token_threshold=rng.choice([0, 0, 3, 7])),
                        policy=rng.choice(["fcfs", "priority"]),
                        async_scheduling=rng.random() < 0.5),
        hybrid_cache_config(windows, block_size=block_size, num_blocks=num_blocks,
                            enable_prefix_caching=rng.random() < 0.75))
    runner = CheckingRunner(scheduler)
    shared = [rng.randrange(1, 50) for _ in range(30)]
    arrivals = sorted(rng.randrange(0, 30) for _ in range(rng.randrange(2, 10)))
    aborts = {rng.randrange(0, 40): f"r{rng.randrange(len(arrivals))}" for _ in range(2)}
    for step in range(2000):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                prompt = shared[:rng.randrange(0, 30)] + [rng.randrange(50)
                                                         for _ in range(rng.randrange(1, 6))]
                params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)
                scheduler.add_request(Request(f"r{i}", prompt, params, float(step),
                                              priority=rng.randrange(3)))
        if step in aborts:
            scheduler.finish_requests([aborts[step]])
        if step > max(arrivals) and not scheduler.has_unfinished_requests():
            break
        runner.step()
    runner.step()  # the last step tells the runner to forget everyone
    assert not runner.tables.rows and not runner.states
    return runner, scheduler


def test_persistent_tables_equal_the_rebuilt_ones_over_random_schedules():
    rng = random.Random(0)
    num_compared = num_null_ids = num_preemptions = num_hits = 0
    for _ in range(150):
        runner, scheduler = random_run(rng)
        num_compared += runner.num_compared
        num_null_ids += runner.num_null_ids
        num_preemptions += scheduler.num_preemptions
        num_hits += scheduler.kv_cache_manager.prefix_cache_hits
    # not vacuous: many steps, with preemptions, prefix hits and null blocks among them
    assert num_compared > 4000 and num_preemptions > 100 and num_hits > 2000
    assert num_null_ids > 100
