"""The C++ extension's kernels release the GIL while they run, as torch's own ops do: while the
worker thread is in one, the engine thread and the asyncio frontend keep running Python."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from aserve.kernels import cpu_gemm


@pytest.mark.skipif(not cpu_gemm.available(), reason="aserve's AVX512-BF16 GEMM is not built here")
def test_another_thread_runs_python_during_a_kernel_call() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = cpu_gemm.PackedWeight(torch.randn(2048, 2048, generator=gen).bfloat16())
    x = torch.randn(1024, 2048, generator=gen).bfloat16()
    stamps: list[float] = []
    done = threading.Event()

    def tick() -> None:  # a stamp a millisecond; each one needs the GIL
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4.3 GFLOP on one core: over 10 ms however fast the core
    ticker = threading.Thread(target=tick)
    try:
        weight.linear(x)  # built and warm
        ticker.start()
        most = 0
        for _ in range(3):
            start = time.perf_counter()
            weight.linear(x)
            end = time.perf_counter()
            most = max(most, sum(start < t < end for t in stamps))
    finally:
        done.set()
        if ticker.is_alive():
            ticker.join()
        torch.set_num_threads(threads)
    # Holding the GIL, a call would let in at most the stamp taken as it returns.
    assert most >= 4
