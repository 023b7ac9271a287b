"""The C++ bf16 `gelu_tanh_and_mul` against its oracle, torch's bf16
`F.gelu(gate, approximate="tanh") * up`: bit-equal over every bf16 gate value and every shape where
torch runs its vectorized loop (Sleef's tanh, whose saturation at |x| > 8.66 the kernel copies),
within one float ulp of tanh at row tails (torch's scalar loop, glibc's tanh), and NaN / inf
where torch has them. One exception, from the AVX512-BF16 conversion aserve's `simd.h` uses:
a float result below float's smallest normal (bf16 subnormals) comes out as a zero."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import cpu_elementwise

TINY = torch.finfo(torch.bfloat16).tiny  # the smallest normal


@pytest.fixture(autouse=True)
def _kernels():
    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")


def ordered(x: torch.Tensor) -> torch.Tensor:
    """bf16 bits as ints in the order of their values (+0 and -0 both 0): a difference is ulps."""
    bits = x.view(torch.int16).int()
    return torch.where(bits >= 0, bits, -(bits + 32768))


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per element: how many bf16 values apart; NaN against NaN is 0, against a number huge."""
    nan = got.isnan() | want.isnan()
    apart = (ordered(got) - ordered(want)).abs()
    return torch.where(nan, torch.where(got.isnan() & want.isnan(), 0, 1 << 20), apart)


def flushed(x: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where torch's gelu(gate) or result is a subnormal (or the smallest normal, rounded up
    from one) and the kernel's result a zero: the one documented difference."""
    act = torch.nn.functional.gelu(x.chunk(2, dim=-1)[0], approximate="tanh")
    return ((act.float().abs() <= TINY) | (want.float().abs() <= TINY)) & (got == 0)


def every_bf16_value(rows: int = 256) -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(rows, -1)  # [256, 256]


@pytest.mark.parametrize("up", ["ones", "random"])
def test_bit_equal_to_torch_for_every_bf16_gate_value(up):
    gate = every_bf16_value()
    gen = torch.Generator().manual_seed(0)
    up_t = torch.ones_like(gate) if up == "ones" else torch.randn(gate.shape, generator=gen)
    x = torch.cat([gate, up_t.bfloat16()], dim=-1)  # [256, 2 * 256]: torch's vectorized path
    got = cpu_elementwise.gelu_tanh_and_mul(x)
    want = cpu_elementwise.gelu_tanh_and_mul_ref(x)
    off = ulps(got, want) != 0
    assert not (off & ~flushed(x, got, want)).any(), gate[off & ~flushed(x, got, want)][:8]
    assert off.sum() < 1024  # the subnormal results only


def vectorized_ref(x: torch.Tensor) -> torch.Tensor:
    """torch's bf16 gelu(gate) * up with every gate element in torch's vectorized loop (Sleef's
    tanh): gate flattened and padded to whole vectors. (Row tails of `gelu_tanh_and_mul_ref`
    run torch's scalar loop, glibc's tanh, one float ulp apart at times.)"""
    gate, up = x.chunk(2, dim=-1)
    flat = gate.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % 64)])
    act = torch.nn.functional.gelu(padded, approximate="tanh")[:flat.numel()]
    return act.view(gate.shape) * up


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("d", [16, 17, 64, 100, 1536, 4096 + 5])
@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0, 1e4])
def test_matches_torch_over_shapes(rows, d, scale):
    gen = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, 2 * d, generator=gen) * scale).bfloat16()
    got = cpu_elementwise.gelu_tanh_and_mul(x)
    assert got.shape == (rows, d) and got.dtype == torch.bfloat16
    want = vectorized_ref(x)
    assert torch.where(flushed(x, got, want), 0, ulps(got, want)).max() == 0
    # the reference itself: one bf16 ulp, or where 1 + tanh cancels (x < -5) one float ulp
    # of tanh (times x * up / 2) apart
    gate, up = x.float().chunk(2, dim=-1)
    want = cpu_elementwise.gelu_tanh_and_mul_ref(x)
    slack = (got.float() - want.float()).abs() <= 2**-23 * (gate * up).abs()
    assert torch.where(slack | flushed(x, got, want), 0, ulps(got, want)).max() <= 1


def test_inf_nan_and_huge_inputs_as_torch():
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor([inf, -inf, nan, 3e38, -3e38, 1e30, -1e30, 100.0, -100.0, -5.1, 0.0,
                         -0.0, 8.0, -8.0, 1e-3, -1e-3, 2.0])  # 17: one vector and a tail
    up = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, -1.0, -1.0, inf, inf, 1.0, inf, 1.0, -inf,
                       nan, 1e38, 1e38, 0.5])
    x = torch.cat([gate, up]).bfloat16().unsqueeze(0)
    got = cpu_elementwise.gelu_tanh_and_mul(x)
    want = vectorized_ref(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert ulps(got, want).max() == 0, (got, want)
    assert torch.equal(got.signbit() | got.isnan(), want.signbit() | want.isnan())


def test_leading_dims_are_kept():
    x = torch.randn(2, 3, 2 * 48).bfloat16()
    got = cpu_elementwise.gelu_tanh_and_mul(x)
    assert got.shape == (2, 3, 48)
    assert torch.equal(got, cpu_elementwise.gelu_tanh_and_mul_ref(x))
