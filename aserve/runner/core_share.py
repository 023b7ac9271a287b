"""`CoreShare`: the CPU worker's OpenMP team sized to the cores other processes leave it.

An OpenMP team meets at a barrier at the end of every parallel region (a decode step has
hundreds). Beside a busy process on one of its cores, the team's thread there gets part of that
core, and the others spin at each barrier until it arrives: beside one busy process on 2 cores
aserve kept 0.31 of its throughput alone (`benchmarks/contention.py`), where half the cores
should keep about half. So every `INTERVAL` seconds, between steps, the worker reads how busy
its CPUs were (`/proc/stat`, the CPUs of its affinity mask) and how much of that was its own
(`/proc/self/stat`); the rest is other processes', and the team gives up a thread for each
core they keep busy, counting a core from SHRINK_AT of one (beside a process busy half the
time a team of two and a team of one ran level on 2 cores, 84 and 81 tok/s; a quarter of the
time, 109 and 77; three quarters, 70 and 74), between 1 and the team it started with
(`torch.get_num_threads()`: the CPUs of its mask, or OMP_NUM_THREADS). A new size takes two
readings in a row that agree (one busy second of another process is not a reason).
`ASERVE_SHARE_CORES=0` turns it off; it runs only where a single rank computes on the host's
cores (ranks of one node split the cores among themselves).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

INTERVAL = 1.0  # seconds between readings
ENV = "ASERVE_SHARE_CORES"
SHRINK_AT = 0.6  # of a core kept busy by other processes: one thread fewer


def read_cpu_busy(cpus: set[int]) -> float | None:
    """Clock ticks the CPUs `cpus` have spent busy (user, nice, system, irq, softirq) since
    boot; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, rest.split()[:7])
            busy += user + nice + system + irq + softirq
    return float(busy)


def read_own_busy() -> float | None:
    """Clock ticks this process's threads have run (user + system); None without /proc."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return float(int(fields[11]) + int(fields[12]))  # utime, stime (fields 14 and 15)


class CoreShare:
    """`step()` between steps; the team size it set is `threads`."""

    def __init__(self, max_threads: int, cpus: set[int],
                 set_threads: Callable[[int], None],
                 read_cpus: Callable[[set[int]], float | None] = read_cpu_busy,
                 read_own: Callable[[], float | None] = read_own_busy,
                 clock: Callable[[], float] = time.monotonic,
                 ticks_per_second: float | None = None) -> None:
        self.max_threads, self.cpus, self.threads = max_threads, cpus, max_threads
        self._set_threads, self._read_cpus, self._read_own = set_threads, read_cpus, read_own
        self._clock = clock
        self._hz = ticks_per_second or float(os.sysconf("SC_CLK_TCK"))
        self._last = self._reading()
        self._proposed: int | None = None

    def _reading(self) -> tuple[float, float, float] | None:
        cpus, own = self._read_cpus(self.cpus), self._read_own()
        return None if cpus is None or own is None else (self._clock(), cpus, own)

    def step(self) -> None:
        if self._last is None or self._clock() - self._last[0] < INTERVAL:
            return
        now = self._reading()
        if now is None:
            self._last = None  # (no /proc: nothing to follow)
            return
        seconds = now[0] - self._last[0]
        others = ((now[1] - self._last[1]) - (now[2] - self._last[2])) / self._hz / seconds
        self._last = now
        taken = math.floor(max(others, 0.0) + 1.0 - SHRINK_AT)
        target = min(self.max_threads, max(1, len(self.cpus) - taken))
        if target == self.threads:
            self._proposed = None
        elif target == self._proposed:
            logger.info("CPU threads %d -> %d: other processes keep %.2f of the %d cores busy",
                        self.threads, target, others, len(self.cpus))
            self.threads, self._proposed = target, None
            self._set_threads(target)
        else:
            self._proposed = target


def core_share_for_worker(single_rank_on_cpu: bool) -> CoreShare | None:
    """The worker thread's `CoreShare` (built in that thread: an OpenMP team size is the
    calling thread's), or None where it does not apply or is turned off."""
    if not single_rank_on_cpu or os.environ.get(ENV, "1") == "0":
        return None
    import torch

    cpus = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    if threads < 2 or read_cpu_busy(cpus) is None or read_own_busy() is None:
        return None
    return CoreShare(threads, cpus, torch.set_num_threads)
