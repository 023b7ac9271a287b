"""`CompilePool`: grammar compiles in worker processes of their own, cheapest first.

    submit(text) ─► queue, smallest first ─┬─► slot 0: thread "aserve-grammar-compile_0" ─► worker
                                           └─► slot 1: thread "aserve-grammar-compile_1" ─► worker

A job over `small_job_chars` ("large") runs on at most num_workers - 1 slots at once: one slot
is always left to small jobs, which wait behind small ones only, and the queue gives a free slot
the smallest job waiting.

A worker is a process (`compile_worker.py`) that one slot thread feeds one job at a time and
waits on (the thread holds no GIL while it waits). `cancel(job)` drops a queued job and kills a
running job's process, so a compile nobody waits for any more holds no slot; the slot starts a
fresh process for its next job. A process that dies mid-job on its own (llguidance overflowing
its stack on a deeply nested grammar, or running out of its memory cap) fails that job with
`WorkerDied`; the server lives on.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import resource
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

logger = logging.getLogger(__name__)
SMALL_JOB_CHARS = 16 << 10  # a constraint this short compiles in tens of ms at most
WORKER_MEMORY_BYTES = 4 << 30  # a worker's address space


class WorkerDied(RuntimeError):
    """The worker compiling a job exited before answering (killed, or crashed on the job)."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__(f"the compile worker exited with {returncode}")
        self.returncode = returncode


class CompileJob:
    """One compile: its `constraint_job` text; `future` gets the worker's reply dict (or
    `WorkerDied`). Ordered by size, then by arrival."""

    def __init__(self, text: str, seq: int) -> None:
        self.text, self.size, self.seq = text, len(text), seq
        self.future: Future[dict] = Future()
        self.slot: _Slot | None = None  # while running

    def __lt__(self, other: CompileJob) -> bool:
        return (self.size, self.seq) < (other.size, other.seq)


class _Slot:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool, self.index = pool, index
        self.process: subprocess.Popen | None = None  # replaced under the pool's lock
        self.needs_setup = False
        self.job: CompileJob | None = None  # the job it runs (set under the pool's lock)

    def spawn(self) -> None:
        """A fresh worker (under the pool's lock: `cancel` kills what it finds here); if it
        cannot start, none (its next job fails)."""
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "aserve.structured_output.compile_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        except OSError:
            logger.exception("A grammar compile worker could not start.")
            return
        self.needs_setup = True

    def run(self) -> None:
        self._setup()  # the process started with the pool: its tokenizer, before any job
        while (job := self.pool._take(self)) is not None:
            try:
                reply: dict | WorkerDied = self._compile(job)
            except WorkerDied as e:
                reply = e
            self.pool._finish(self, job, reply)
        self._reap()

    def _compile(self, job: CompileJob) -> dict:
        process = self.process
        if process is None:  # it could not be started
            raise WorkerDied(None)
        try:
            self._setup()
            process.stdin.write(job.text.encode() + b"\n")
            process.stdin.flush()
            line = process.stdout.readline()
        except OSError:  # a broken pipe: the process is gone
            line = b""
        if not line.endswith(b"\n"):  # it died, mid-reply or before
            raise WorkerDied(self._reap())
        return json.loads(line)

    def _setup(self) -> None:
        """The worker's first line, once per process (a broken pipe shows at the next job)."""
        if self.needs_setup and self.process is not None:
            self.needs_setup = False
            try:
                self.process.stdin.write(self.pool.setup_line)
                self.process.stdin.flush()
            except OSError:
                pass

    def _reap(self) -> int | None:
        with self.pool._cond:
            process, self.process = self.process, None
        if process is None:
            return None
        process.kill()
        for pipe in (process.stdin, process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return process.wait()


class CompilePool:
    """`num_workers` (at least 2) worker processes compiling `constraint_job` texts; `setup`
    is the workers' first line (`compile_worker.py`). Threads and processes start with the
    first job; `close()` ends them."""

    def __init__(self, setup: dict, num_workers: int = 2,
                 small_job_chars: int = SMALL_JOB_CHARS) -> None:
        self.setup_line = (json.dumps({"memory_bytes": WORKER_MEMORY_BYTES,
                                       "stack_bytes": worker_stack_bytes(), **setup})
                           + "\n").encode()
        self.small_job_chars = small_job_chars
        self.max_large_running = max(num_workers, 2) - 1
        self._slots = [_Slot(self, i) for i in range(max(num_workers, 2))]
        self._cond = threading.Condition()
        self._queue: list[CompileJob] = []  # a heap
        self._seq = itertools.count()
        self._started = self._closed = False
        self.num_large_running = 0

    def submit(self, text: str) -> CompileJob:
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            job = CompileJob(text, next(self._seq))
            heapq.heappush(self._queue, job)
            if not self._started:
                self._start()
            self._cond.notify_all()
        return job

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for `job` any more: drop it if queued, kill its worker if running."""
        if job.future.cancel():
            return  # queued: `_take` skips it
        with self._cond:
            slot = job.slot
            if slot is not None and slot.process is not None:
                slot.process.kill()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            queued, self._queue = self._queue, []
            for slot in self._slots:
                if slot.process is not None:
                    slot.process.kill()
            self._cond.notify_all()
        for job in queued:
            job.future.cancel()

    def _start(self) -> None:
        self._started = True
        for slot in self._slots:
            slot.spawn()  # warming up (imports) while the first job is on its way
            threading.Thread(target=slot.run, name=f"aserve-grammar-compile_{slot.index}",
                             daemon=True).start()

    def _take(self, slot: _Slot) -> CompileJob | None:
        """The next job `slot` may run (waiting for one), or None once closed."""
        with self._cond:
            while not self._closed:
                while self._queue and self._queue[0].future.cancelled():
                    heapq.heappop(self._queue)
                if self._queue and (not self._is_large(self._queue[0])
                                    or self.num_large_running < self.max_large_running):
                    job = heapq.heappop(self._queue)
                    if not job.future.set_running_or_notify_cancel():
                        continue
                    job.slot, slot.job = slot, job
                    self.num_large_running += self._is_large(job)
                    if slot.process is None:
                        slot.spawn()
                    return job
                self._cond.wait()
            return None

    def _finish(self, slot: _Slot, job: CompileJob, reply: dict | WorkerDied) -> None:
        with self._cond:
            job.slot = slot.job = None
            self.num_large_running -= self._is_large(job)
            self._cond.notify_all()
        if isinstance(reply, WorkerDied):
            job.future.set_exception(reply)
        else:
            job.future.set_result(reply)

    def _is_large(self, job: CompileJob) -> bool:
        return job.size > self.small_job_chars

    def check_invariants(self) -> None:
        with self._cond:
            running = [s.job for s in self._slots if s.job is not None]
            assert all(job.slot is s for s in self._slots if (job := s.job) is not None)
            assert all(job.slot is None for job in self._queue), "a queued job has a slot"
            assert self.num_large_running == sum(map(self._is_large, running))
            assert self.num_large_running <= self.max_large_running
            assert not any(self._queue[i] < self._queue[(i - 1) // 2]
                           for i in range(1, len(self._queue))), "not a heap"


def worker_stack_bytes() -> int:
    """Half the stack this process's threads get (what the runner builds matchers on), so a
    grammar that compiles in a worker builds its matcher there too: `threading.stack_size()`,
    else RLIMIT_STACK (glibc's thread default), else (unlimited) glibc's 2 MiB."""
    size = threading.stack_size()
    if not size:
        soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
        size = 2 << 20 if soft == resource.RLIM_INFINITY else soft
    return min(max(size // 2, 256 << 10), 64 << 20) // 4096 * 4096
