"""The Triton W4A16 / W8A16 GEMM (`kernels/quant_gemm_triton.py`) against its torch twin, on
the GPU where there is one, else under the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1 before any kernel is decorated): 4 and 8 bits, groups of 16 to 128, row
counts below and across a tile, widths that leave a tile partly empty, a bias, float32
output; the layout reads back as the weight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from aserve.kernels.quant_gemm_triton import (  # noqa: E402
    TritonQuantWeight,
    _quant_gemm_kernel,
    reference,
)
from aserve.kernels.triton_utils import is_interpreted  # noqa: E402
from aserve.quantization.int_weights import IntWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not is_interpreted(_quant_gemm_kernel):
    pytest.skip("no GPU, and the kernel was decorated before TRITON_INTERPRET=1 was set",
                allow_module_level=True)


def int_weight(rows: int, cols: int, group: int, bits: int) -> IntWeight:
    g = torch.Generator().manual_seed(rows * cols + bits)
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // group, generator=g) * 0.02 + 0.001
    low = -torch.rand(rows, cols // group, generator=g) * 2 ** bits * 0.01
    return IntWeight(q, scale, low, group, bits)


@pytest.mark.parametrize("rows, cols, group, bits, m, dtype", [
    (70, 128, 32, 4, 1, torch.float32), (64, 96, 16, 8, 3, torch.float32),
    (130, 256, 128, 4, 20, torch.float16), (40, 64, 32, 6, 33, torch.bfloat16)])
def test_the_gemm_is_its_twin(rows, cols, group, bits, m, dtype):
    w = int_weight(rows, cols, group, bits)
    packed = TritonQuantWeight(w, DEVICE)
    x = torch.randn(m, cols, dtype=dtype)
    bias = torch.randn(rows, dtype=dtype)
    expected = reference(x, w, bias)
    got = packed.linear(x.to(DEVICE), bias.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (m, rows)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2,
                                                                        "rtol": 3e-2}
    torch.testing.assert_close(got.float(), expected, **tol)
    floats = packed.linear_float(x.view(1, m, cols).to(DEVICE)).cpu()
    assert floats.dtype == torch.float32 and floats.shape == (1, m, rows)
    torch.testing.assert_close(floats[0], reference(x, w), **tol)


def test_the_layout_reads_back_as_the_weight():
    w = int_weight(20, 64, 32, 4)
    packed = TritonQuantWeight(w, DEVICE)
    stored = packed.int_weight()
    assert torch.equal(stored.q, w.q) and stored.bits == 4
    index = torch.tensor([3, 0, 19])
    expected = IntWeight(w.q, w.scale.half().float(), w.min.half().float(), 32, 4).dequantize()
    assert torch.equal(packed.rows(index.to(DEVICE)).cpu(), expected[index])


def test_the_gpu_platform_packs_quantized_weights_only():
    from aserve.backends.ops import LinearToPack
    from aserve.backends.triton_ops import pack_quantized, triton_kernel_ops

    assert triton_kernel_ops(torch.bfloat16).pack_linears is pack_quantized
    w = int_weight(48, 64, 32, 4)
    float_weight = torch.randn(48, 64, dtype=torch.bfloat16)
    packed = pack_quantized([LinearToPack(float_weight, False, lambda: w),
                             LinearToPack(float_weight, True, None),
                             LinearToPack(float_weight, False, lambda: None)])
    assert isinstance(packed[0], TritonQuantWeight) and packed[1:] == [None, None]
    assert packed[0].quantization == "int4 g32"
