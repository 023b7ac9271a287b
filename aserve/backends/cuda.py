"""The CUDA platform: NVIDIA GPUs through torch's CUDA build, NCCL, Triton kernels, graphs.

ROCm builds of torch also answer to `torch.cuda`; they get `rocm.py`, which subclasses this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aserve.backends.base import Platform, Probe
from aserve.backends.ops import KernelOps
from aserve.backends.triton_ops import triton_kernel_ops


class CudaPlatform(Platform):
    """NVIDIA GPUs: one device per rank, `cuda:<local_rank>`."""

    name = "cuda"
    dist_backend = "nccl"
    supports_graphs = True

    @staticmethod
    def probe() -> Probe:
        build = f"torch {torch.__version__}"
        if torch.version.hip is not None:
            return Probe(False, f"torch.version.hip is {torch.version.hip!r}: {build} is a ROCm "
                                "build (use --device rocm)")
        if torch.version.cuda is None:
            return Probe(False, f"torch.version.cuda is None: {build} is built without CUDA")
        if not torch.cuda.is_available():
            return Probe(False, f"torch.cuda.is_available() is False ({build}, CUDA "
                                f"{torch.version.cuda}): no visible GPU or no driver")
        return Probe(True, f"{torch.cuda.device_count()} CUDA device(s), CUDA {torch.version.cuda}")

    def device_for_rank(self, local_rank: int) -> torch.device:
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no {self.name} device: "
                             f"{count} visible (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
        return torch.device("cuda", local_rank)

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def mem_info(self, device: torch.device | None = None) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def graph_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], torch.Tensor], pool: object
                      ) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    def kernel_ops(self, dtype: torch.dtype) -> KernelOps:
        """The Triton kernels (`triton_ops`)."""
        return triton_kernel_ops(dtype)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated())
