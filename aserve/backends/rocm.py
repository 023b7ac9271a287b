"""The ROCm platform: AMD GPUs through torch's HIP build.

torch keeps the "cuda" device type, `torch.cuda` API and the "nccl" backend name on ROCm (RCCL
answers to it), so everything but the name and the probe is the CUDA adapter's.
"""

from __future__ import annotations

import torch

from aserve.backends.base import Probe
from aserve.backends.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    """AMD GPUs: devices `cuda:<local_rank>`, RCCL, Triton attention, HIP graphs."""

    name = "rocm"

    @staticmethod
    def probe() -> Probe:
        if torch.version.hip is None:
            return Probe(False, f"torch.version.hip is None: torch {torch.__version__} is not a "
                                "ROCm build")
        if not torch.cuda.is_available():
            return Probe(False, f"torch.cuda.is_available() is False (ROCm build, HIP "
                                f"{torch.version.hip}): no visible AMD GPU or no driver")
        return Probe(True, f"{torch.cuda.device_count()} ROCm device(s), HIP {torch.version.hip}")
