"""What every Triton launcher in `aserve/kernels` checks first: that triton is installed, and that
the tensors sit where the kernel can run (a CUDA/ROCm device, or anywhere under the Triton
interpreter, `TRITON_INTERPRET=1`, which tests use on CPU). Not a kernel itself."""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # the kernel modules still import; launching raises `require_triton`'s error
    triton = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted(kernel: object) -> bool:
    """Whether `kernel` was built for the interpreter (TRITON_INTERPRET=1 when it was decorated).

    The interpreter computes on numpy arrays that hold bfloat16 as raw uint16 bits: its `tl.dot`
    and arithmetic on bfloat16 are wrong, so kernels upcast to float32 first when this is True.
    """
    return type(kernel).__name__ == "InterpretedFunction"


def require_triton(name: str, kernel: object, *tensors: torch.Tensor) -> None:
    """Raise RuntimeError without triton, ValueError when a tensor is off-device for `kernel`."""
    if triton is None:
        raise RuntimeError(f"{name} needs the `triton` package (pip install 'triton>=3.1'); "
                           "without it use the torch `*_ref` twin.")
    if is_interpreted(kernel):
        return
    for x in tensors:
        if x.device.type != "cuda":
            raise ValueError(f"{name} runs on CUDA/ROCm devices (or under TRITON_INTERPRET=1), "
                             f"got a tensor on {x.device}.")


def check_float(name: str, **tensors: torch.Tensor) -> None:
    """Each tensor is float32/16 or bfloat16 with a contiguous last dim."""
    for arg, x in tensors.items():
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: {arg} must be float32, float16 or bfloat16, got {x.dtype}.")
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: {arg} must be contiguous in its last dim, "
                             f"got strides {x.stride()}.")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
