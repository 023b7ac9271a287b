"""`BlockTables`: the block ids of every request the runner holds, one persistent row per
request in one int32 table per KV cache group, kept in step with the scheduler's diffs.

    group g's table  [num_rows, num_cols] int32; each row zero past its own length
    row 0  "r7"  │ 12  13  40   0   0 │  num_blocks[g, 0] = 3
    row 1  free  │  0   0   0   0   0 │  (the next request added takes it)
    row 2  "r3"  │  0   0  51  52  57 │  num_blocks[g, 2] = 5 (a sliding group: two null blocks)

A request the runner has not seen (new, or resumed after preemption: the scheduler sends it
whole again) takes a free row and writes its ids; a running one appends its
`CachedRequestData.new_block_ids`; a finished or preempted one zeroes its row and frees it.
Ids the scheduler nulls later (a sliding window moving on) are never re-sent, so a row keeps the
stale id, as the runner's lists always did: attention never reads there. Tables grow by
doubling (rows or columns) when a request needs more, so no limit has to be known up front.

`gather(req_ids)` is a step's tables in batch order: the rows gathered and cut to the longest of
them, zero-padded — what rebuilding each table from the requests' lists gives, in one copy per
group instead of one list-to-array conversion per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import attrgetter

import numpy as np

from aserve.core.outputs import SchedulerOutput

NEW_BLOCK_IDS = attrgetter("new_block_ids")


class BlockTables:
    def __init__(self, num_groups: int, num_rows: int = 64, num_cols: int = 64) -> None:
        self.tables = [np.zeros((num_rows, num_cols), dtype=np.int32) for _ in range(num_groups)]
        self.num_blocks = np.zeros((num_groups, num_rows), dtype=np.int32)  # [group, row]
        self.rows: dict[str, int] = {}  # request id → its row
        self.free_rows = list(range(num_rows - 1, -1, -1))  # a stack: the last freed first

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    def update(self, so: SchedulerOutput) -> None:
        """Apply a step's schedule: forget finished and preempted requests, add those sent
        whole, append the running ones' new ids."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.remove(req_id)
        for new in so.scheduled_new_reqs:
            self.add(new.req_id, new.block_ids)
        cached = so.scheduled_cached_reqs  # (most steps of most requests: no new block;
        # picked out by C-level maps, no bytecode a request)
        for req_id, new_block_ids, _ in compress(cached, map(any, map(NEW_BLOCK_IDS, cached))):
            self.append(req_id, new_block_ids)

    def add(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """A request sent whole (`NewRequestData.block_ids`, one list per group)."""
        self.remove(req_id)
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.rows[req_id] = row
        self._write(row, block_ids)

    def append(self, req_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        """A running request's diff (`CachedRequestData.new_block_ids`)."""
        self._write(self.rows[req_id], new_block_ids)

    def remove(self, req_id: str) -> None:
        """Forget a request (finished, aborted or preempted); its row is zeroed and free."""
        row = self.rows.pop(req_id, None)
        if row is None:
            return
        for group, table in enumerate(self.tables):
            table[row, :self.num_blocks[group, row]] = 0
        self.num_blocks[:, row] = 0
        self.free_rows.append(row)

    def gather(self, req_ids: Sequence[str]) -> list[np.ndarray]:
        """Per group, [len(req_ids), longest of their rows] int32: row i is request i's ids."""
        rows = np.fromiter(map(self.rows.__getitem__, req_ids), dtype=np.intp,
                           count=len(req_ids))
        widths = self.num_blocks[:, rows].max(axis=1, initial=0)  # [group]
        return [table[rows, :width] for table, width in zip(self.tables, widths.tolist())]

    def check_invariants(self) -> None:
        """Every row is held by one request or free, and zero past its length."""
        held = sorted(self.rows.values())
        assert len(set(held)) == len(held), "a row held twice"
        assert sorted(held + self.free_rows) == list(range(self.num_blocks.shape[1]))
        for group, table in enumerate(self.tables):
            past = np.arange(table.shape[1]) >= self.num_blocks[group][:, None]
            assert not table[past].any(), f"group {group}: ids past a row's length"

    def _write(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != self.num_groups:
            raise ValueError(f"block ids for {len(block_ids)} KV cache groups, the runner has "
                             f"{self.num_groups}.")
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            start = int(self.num_blocks[group, row])
            end = start + len(ids)
            if end > self.tables[group].shape[1]:
                self._grow_cols(group, end)
            self.tables[group][row, start:end] = ids
            self.num_blocks[group, row] = end

    def _grow_rows(self) -> None:
        num_rows = self.num_blocks.shape[1]
        extra = max(1, num_rows)
        self.tables = [np.pad(table, ((0, extra), (0, 0))) for table in self.tables]
        self.num_blocks = np.pad(self.num_blocks, ((0, 0), (0, extra)))
        self.free_rows.extend(range(num_rows + extra - 1, num_rows - 1, -1))

    def _grow_cols(self, group: int, need: int) -> None:
        num_cols = self.tables[group].shape[1]
        extra = max(need, 2 * num_cols) - num_cols
        self.tables[group] = np.pad(self.tables[group], ((0, 0), (0, extra)))
