"""CoreShare: the worker's OpenMP team follows the cores other processes leave it, on readings
that agree twice, within 1 and its starting size; the /proc readers read real counters."""

from __future__ import annotations

import os
import sys
import time

import pytest

from aserve.runner import core_share
from aserve.runner.core_share import INTERVAL, CoreShare, read_cpu_busy, read_own_busy

HZ = 100.0


class Machine:
    """Fake clock and tick counters: `run(seconds, others, own)` advances them as if other
    processes kept `others` of the CPUs busy and this one `own`."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.set: list[int] = []

    def run(self, seconds: float, others: float, own: float) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds * HZ
        self.own += own * seconds * HZ

    def share(self, max_threads: int = 2, cpus: int = 2) -> CoreShare:
        return CoreShare(max_threads, set(range(cpus)), self.set.append,
                         read_cpus=lambda _: self.busy, read_own=lambda: self.own,
                         clock=lambda: self.now, ticks_per_second=HZ)


def test_the_team_shrinks_beside_a_busy_process_and_grows_back_when_it_leaves(caplog) -> None:
    caplog.set_level("INFO", logger="aserve.runner.core_share")
    m = Machine()
    share = m.share()
    for _ in range(5):  # alone: every core its own
        m.run(INTERVAL, others=0.0, own=2.0)
        share.step()
    assert m.set == [] and share.threads == 2
    m.run(INTERVAL, others=0.7, own=1.3)  # a busy process arrives: one reading proposes 1 ...
    share.step()
    assert m.set == []
    m.run(INTERVAL, others=0.7, own=1.3)  # ... the second, agreeing, sets it
    share.step()
    assert m.set == [1] and share.threads == 1
    assert "CPU threads 2 -> 1: other processes keep 0.70 of the 2 cores busy" in caplog.text
    for _ in range(3):
        m.run(INTERVAL, others=1.0, own=1.0)
        share.step()
    assert m.set == [1]
    m.run(INTERVAL, others=0.0, own=1.0)  # it left
    share.step()
    m.run(INTERVAL, others=0.0, own=1.0)
    share.step()
    assert m.set == [1, 2] and share.threads == 2


def test_a_single_busy_reading_or_a_light_process_changes_nothing() -> None:
    m = Machine()
    share = m.share()
    for others in (1.0, 0.0, 1.0, 0.0, 0.3, 0.5, 0.55):  # never two heavy readings in a row
        m.run(INTERVAL, others=others, own=2.0 - others)
        share.step()
    assert m.set == []


def test_readings_come_once_an_interval_and_the_size_stays_within_1_and_the_start() -> None:
    m = Machine()
    share = m.share(max_threads=3, cpus=4)  # OMP_NUM_THREADS=3 on 4 CPUs: never above 3
    for _ in range(4):
        m.run(INTERVAL / 4, others=0.0, own=3.0)
        share.step()
    for _ in range(2):
        m.run(INTERVAL, others=3.9, own=0.1)  # every core taken: still one thread
        share.step()
    assert m.set == [1]
    for _ in range(2):
        m.run(INTERVAL, others=0.0, own=1.0)
        share.step()
    assert m.set == [1, 3]


def test_without_readings_it_does_nothing() -> None:
    m = Machine()
    share = CoreShare(2, {0, 1}, m.set.append, read_cpus=lambda _: None,
                      read_own=lambda: 0.0, clock=lambda: m.now, ticks_per_second=HZ)
    for _ in range(3):
        m.run(INTERVAL, others=1.0, own=1.0)
        share.step()
    assert m.set == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_proc_readers_count_this_process_and_its_cpus() -> None:
    cpus = os.sched_getaffinity(0)
    busy0, own0 = read_cpu_busy(cpus), read_own_busy()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn 0.3 s of CPU
        pass
    busy1, own1 = read_cpu_busy(cpus), read_own_busy()
    hz = os.sysconf("SC_CLK_TCK")
    assert (own1 - own0) / hz >= 0.2  # (ticks: 10 ms apart)
    assert busy1 - busy0 >= own1 - own0 - 2  # our CPUs were at least as busy as we were


def test_it_is_off_for_several_ranks_or_when_turned_off(monkeypatch) -> None:
    monkeypatch.setattr(core_share.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    assert core_share.core_share_for_worker(False) is None
    monkeypatch.setenv(core_share.ENV, "0")
    assert core_share.core_share_for_worker(True) is None
    monkeypatch.delenv(core_share.ENV)
    if sys.platform.startswith("linux"):
        assert core_share.core_share_for_worker(True) is not None
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    assert core_share.core_share_for_worker(True) is None  # one thread: nothing to share
