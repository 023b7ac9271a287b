"""The `Platform` interface: everything the rest of aserve may ask of a device kind.

One adapter per kind implements it (`cuda.py`, `rocm.py`, `xla.py`, `cpu.py`); `aserve.backends`
picks one. This module holds the contract and the few defaults every kind shares, nothing that
touches a particular device.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from aserve.backends.ops import REF_OPS, KernelOps


@dataclass(frozen=True)
class Probe:
    """What a platform's availability check found.

    available: whether this process can run on the platform.
    detail: what was checked and what it returned, in words, e.g.
        "torch.cuda.is_available() is False (torch 2.6.0+cpu, built without CUDA)";
        selection errors quote it so that the user sees why a device was refused.
    auto_selectable: whether "--device auto" may pick the platform when it is available; False
        for a device that only an explicit choice should get (torch_xla's PJRT CPU device,
        which is the host CPU behind a slower, compiling path).
    """

    available: bool
    detail: str
    auto_selectable: bool = True


class Platform(ABC):
    """One device kind (cuda, rocm, xla, cpu) as the runner, layers and distributed see it.

    Class-level facts (the same for every device of the kind):
        name: "cuda" | "rocm" | "xla" | "cpu", as spelled by `--device`.
        dist_backend: torch.distributed backend for process groups: "nccl" (RCCL on ROCm under
            the same name), "gloo" or "xla".
        supports_graphs: whether decode batches may be captured as CUDA/HIP graphs; such a
            platform also has `graph_pool()` (a memory pool every captured graph shares) and
            `capture_graph(fn, pool) -> (replay, output)` (capture the warmed-up `fn`; each
            replay rewrites `output` in place from the tensors `fn` read at capture).
        supports_inference_mode: whether steps may run under `torch.inference_mode` (else
            `torch.no_grad`: torch_xla cannot make inference tensors).
        static_shapes: whether the runner pads each batch's token count to a power of two, so
            that a compiling backend (XLA) sees few distinct shapes.
        computes_on_host: whether the forward runs on the host's cores (the CPU), so that host
            work beside it (a grammar's token mask) takes cores from it rather than idle time.
        default_max_num_batched_tokens: the engine step's token budget when the user sets
            none: large enough that the step's GEMMs run at full rate, no larger (a bigger
            step only delays the first token of every request in it).

    Contract:
        - `probe()` is a static method that never raises and has no side effect beyond importing
          the platform's torch extension (torch_xla); selection calls it, tests replace it.
        - Constructing a platform does not touch the device; only the methods below do.
        - `device_for_rank(local_rank)` is the torch device the rank on this node owns; it raises
          ValueError when there is no such device. `set_device` makes it the rank's current device.
        - `mem_info(device)` is (free_bytes, total_bytes) right now, free <= total, both ints.
        - `synchronize(device)` returns once queued work on the device has finished.
        - `empty_cache()` hands cached, unused device memory back; a no-op where there is none.
        - `kernel_ops(dtype)` is every kernel the layers run for activations of `dtype`, one
          frozen `KernelOps` (see `aserve.backends.ops`); the runner binds it to the model once.
        - `default_kv_cache_bytes()` is a KV-cache budget for platforms that cannot size the cache
          by profiling device memory, or None where the runner should profile.
    """

    name: ClassVar[str]
    dist_backend: ClassVar[str]
    supports_graphs: ClassVar[bool] = False
    static_shapes: ClassVar[bool] = False
    computes_on_host: ClassVar[bool] = False
    # The engine step's token budget when the user gives none (--max-num-batched-tokens).
    default_max_num_batched_tokens: ClassVar[int] = 4096
    # The dtype a quantized checkpoint whose config says float16 runs in under --dtype auto,
    # where this platform's float16 path has no integer GEMM (None: float16 as configured).
    quantized_float16_as: ClassVar[torch.dtype | None] = None
    supports_inference_mode: ClassVar[bool] = True

    @staticmethod
    @abstractmethod
    def probe() -> Probe:
        """Whether this process can use the platform, and what was checked to decide."""

    @classmethod
    def is_available(cls) -> bool:
        return cls.probe().available

    @abstractmethod
    def device_for_rank(self, local_rank: int) -> torch.device:
        """The torch device owned by the rank with this node-local index."""

    @abstractmethod
    def mem_info(self, device: torch.device | None = None) -> tuple[int, int]:
        """(free_bytes, total_bytes) of the device's memory now."""

    def set_device(self, device: torch.device) -> None:
        """Make `device` the current device of this process (a no-op where there is none)."""
        return None  # the default: nothing to do

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for queued work on the device; kinds that run eagerly on the host do nothing."""
        return None  # the default: nothing to do

    def empty_cache(self) -> None:
        """Release cached, unused device memory; kinds without a caching allocator do nothing."""
        return None  # the default: nothing to do

    def mark_step(self) -> None:
        """End this step's lazily traced graph and launch it (XLA); the runner calls it once per
        step, after the forward. Kinds that run ops eagerly do nothing."""
        return None  # the default: nothing to do

    def generator_device(self, device: torch.device) -> torch.device:
        """Where `torch.Generator`s for random draws on `device` live; kinds without device
        generators (XLA) draw on the host and copy the draws over."""
        return device

    def seed_everything(self, seed: int) -> None:
        """Seed Python's and torch's generators (torch's seeds every CUDA/HIP device too)."""
        random.seed(seed)
        torch.manual_seed(seed)

    def kernel_ops(self, dtype: torch.dtype) -> KernelOps:
        """The kernels the layers run for activations of `dtype` (the default: the torch
        references). Compiles what must be compiled now, at start-up, not mid-request."""
        return REF_OPS

    def reset_peak_memory(self) -> None:
        """Start counting `peak_memory_bytes` from now."""
        return None  # the default: no allocator statistics

    def peak_memory_bytes(self) -> int:
        """Most bytes torch held on the device since `reset_peak_memory` (0 where unknown)."""
        return 0

    def default_kv_cache_bytes(self) -> int | None:
        """A fixed KV-cache budget, or None: size the cache from `mem_info` after profiling."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
