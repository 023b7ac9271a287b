"""The CPU platform: host memory, gloo collectives, the C++ kernels of `cpu_ops`, no graphs.

Memory comes from /proc/meminfo (MemAvailable, MemTotal), capped by the memory limit of the
cgroup this process sits in (a container's limit, v2 or v1), with `os.sysconf` as the fallback
where there is no /proc (macOS). No psutil.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from aserve.backends.base import Platform, Probe
from aserve.backends.ops import KernelOps

GiB = 1 << 30
MAX_DEFAULT_KV_CACHE_BYTES = 2 * GiB
DEFAULT_KV_CACHE_FRACTION = 0.5  # of the memory available when the cache is sized


class CpuPlatform(Platform):
    """The host CPU: every rank's device is `cpu`.

    `meminfo` and `cgroup` are where memory is read from; tests point them at files of their own.
    """

    name = "cpu"
    dist_backend = "gloo"
    computes_on_host = True
    # its float16 path packs nothing: GPTQ / AWQ (configs in float16) reach the integer GEMM in
    # bfloat16 (vLLM's CPU build casts float16 to bfloat16 too)
    quantized_float16_as = torch.bfloat16

    def __init__(self, meminfo: Path | str = "/proc/meminfo",
                 cgroup: Path | str = "/sys/fs/cgroup") -> None:
        self.meminfo = Path(meminfo)
        self.cgroup = Path(cgroup)
        self._ops: dict[torch.dtype, KernelOps] = {}

    @staticmethod
    def probe() -> Probe:
        return Probe(True, "the host CPU is always available")

    def device_for_rank(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def mem_info(self, device: torch.device | None = None) -> tuple[int, int]:
        """(available, total) host memory in bytes, within this process's cgroup limit.

        Where the OS reports no available figure (sysconf on macOS), available is total.
        """
        free, total = read_meminfo(self.meminfo) or read_sysconf()
        limit = read_cgroup_limit(self.cgroup)
        if limit is not None and limit[0] < total:
            total = limit[0]
            free = min(free, max(limit[0] - limit[1], 0))
        return min(free, total), total

    def kernel_ops(self, dtype: torch.dtype) -> KernelOps:
        """See `cpu_ops`: the C++ extension's kernels (built, or loaded from the torch
        extensions cache, on the first call) where they apply, the references elsewhere."""
        if dtype not in self._ops:
            from aserve.backends.cpu_ops import cpu_kernel_ops

            self._ops[dtype] = cpu_kernel_ops(dtype)
        return self._ops[dtype]

    # A CPU's GEMMs are near their full rate by a few hundred rows, so a larger step gains
    # little; a wave of 8 prompts of 128 tokens then gets its first tokens over 2 steps instead
    # of one 1024-token step: a lower TTFT at the same throughput, where 256 would cost offline
    # throughput (docs/benchmarks/throughput.md, "Fourth run").
    default_max_num_batched_tokens = 512

    def default_kv_cache_bytes(self) -> int:
        """2 GiB (zero-filling more delays the start; docs/benchmarks/throughput.md, "Third
        run"), or half the memory available now when that is less (call it after loading the
        weights, so that they are not counted as available)."""
        free, _ = self.mem_info()
        return min(MAX_DEFAULT_KV_CACHE_BYTES, int(free * DEFAULT_KV_CACHE_FRACTION))


def read_meminfo(path: Path) -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes from a /proc/meminfo file, or None without one."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    kib = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields = value.split()
        if fields and fields[0].isdigit():
            kib[key.strip()] = int(fields[0])
    if "MemTotal" not in kib:
        return None
    available = kib.get("MemAvailable", kib.get("MemFree", kib["MemTotal"]))
    return available * 1024, kib["MemTotal"] * 1024


def read_sysconf() -> tuple[int, int]:
    """(available, total) in bytes from sysconf; available is total where it is not reported."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        available = total
    return available, total


def read_cgroup_limit(root: Path) -> tuple[int, int] | None:
    """(limit, usage) in bytes of the cgroup at `root`, v2 then v1, or None if unlimited.

    Usage leaves out inactive page cache (the kernel reclaims it before it kills anyone), as
    `docker stats` does.
    """
    v2 = (root / "memory.max", root / "memory.current", root / "memory.stat", "inactive_file")
    v1_dir = root / "memory"
    v1 = (v1_dir / "memory.limit_in_bytes", v1_dir / "memory.usage_in_bytes",
          v1_dir / "memory.stat", "total_inactive_file")
    for limit_file, usage_file, stat_file, inactive_key in (v2, v1):
        limit = _read_int(limit_file)
        usage = _read_int(usage_file)
        if limit is None or usage is None:
            continue
        if limit >= 1 << 60:  # v1 spells "no limit" as a number near 2**63
            return None
        inactive = _read_stat(stat_file).get(inactive_key, 0)
        return limit, max(usage - inactive, 0)
    return None


def _read_int(path: Path) -> int | None:
    """An integer file's value; None if missing, unreadable or "max" (cgroup v2's no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stat = {}
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[1].isdigit():
            stat[fields[0]] = int(fields[1])
    return stat
