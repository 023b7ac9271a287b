"""bf16 GEMM for CPUs with AVX512-BF16: `y = x @ W^T (+ b)` over a weight packed once at load.

The weight [N, K] is repacked into panels of 48 output features, k-pairs interleaved the way
`vdpbf16ps` consumes them (one 64-byte vector = 16 features x 2 consecutive k):

    packed[p, kp, v, j, t] = W[48 p + 16 v + j, 2 kp + t]        (zero past N)

and an 8-row x 48-column micro-kernel walks K two at a time (`csrc/gemm.h` describes it, and the
gated packing of an MLP's [gate; up] whose epilogue applies silu(gate) * up).

Without AMX it is at least as fast as oneDNN's prepacked bf16 linear, and faster at decode
batch sizes, where a step streams every weight from memory and its plain panel walk keeps the
memory busier (`benchmarks/studies/gemm.py`; docs/benchmarks/throughput.md, "aserve's CPU GEMM
beside oneDNN"). Sums run in another order than oneDNN's, so results differ from `F.linear` in
the last bf16 bit of some outputs.

On CPUs with AMX (Intel Sapphire Rapids and later) the same panels go to the tile unit instead
(`amx()`): 16 rows x 48 columns per tile product, at every row count, since it wins even at
one row (docs/benchmarks/serving-latency.md, "On a Xeon with AMX"). Its results agree with the
vector tiles' to one bf16 step, most of them bit for bit.

On CPUs with AVX2 but not AVX512-BF16 (AMD Zen 2 and 3, older Xeons) the same panels are read
by 8-wide tiles (`csrc/gemm_avx2.h`: a k-pair's bf16 words made float32 by a shift and an AND,
two FMAs a vector; `isa()` says "avx2"), inside the whole-layer call as AVX-512's are; the
fused MoE stays AVX-512's (`avx512()`).

Built on first use (`cpu_extension.load`); `available()` is False where the CPU or compiler
has neither (the caller then keeps oneDNN or `F.linear`).
"""

from __future__ import annotations

import ctypes
import sys
from itertools import accumulate

import torch

from aserve.kernels import cpu_extension

PANEL = 48  # output features per panel (3 vectors of 16)
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page (x86-64)
MADV_HUGEPAGE = 14
# gemm_linear's epilogues
EPILOGUE_PLAIN, EPILOGUE_GATED_SPLIT, EPILOGUE_GATED_SILU, EPILOGUE_FLOAT = 0, 1, 2, 3


def _module():
    return cpu_extension.load()


def isa() -> str:
    """Which tiles run the packed GEMM here: "avx512" (AVX512-BF16), "avx2" (8-wide tiles over
    the same panels, `csrc/gemm_avx2.h`), or "" (none)."""
    module = _module()
    return "" if module is None else module.gemm_isa()


def available() -> bool:
    """Whether packed bf16 linears run here (`PackedWeight`), on either ISA's tiles."""
    return isa() != ""


def avx512() -> bool:
    """Whether this build has the AVX512-BF16 GEMM, which the fused MoE's C++ (`moe.h`) is
    built on."""
    return isa() == "avx512"


def amx(enabled: bool | None = None) -> bool:
    """Whether GEMMs over K a multiple of 32 run on AMX tiles, which they do wherever the CPU
    and Linux have them; `enabled=False` keeps every GEMM on the vector tiles (tests, A/B
    benchmarks), `True` gives the tiles back."""
    module = _module()
    if module is None:
        return False
    return module.gemm_amx(-1 if enabled is None else int(enabled))


class PackedGemm:
    """What the CPU GEMMs' packed weights share (`PackedWeight`, bf16; the quantized
    `cpu_qgemm.QuantPackedWeight`): a [N, K] weight's `data` in the kernel's layout, and the
    calls over it, each one C++ GEMM (`_gemm`) with an epilogue. `gated`: [gate; up], so that
    `silu_and_mul` comes out of the GEMM."""

    out_features: int
    in_features: int
    gated: bool
    data: torch.Tensor

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N]."""
        return self._apply(x, bias, EPILOGUE_GATED_SPLIT if self.gated else EPILOGUE_PLAIN)

    def linear_float(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`linear(x, bias).float()` in one pass (the bf16 values, stored as float32)."""
        assert not self.gated, "a gated weight has no plain float output"
        return self._apply(x, bias, EPILOGUE_FLOAT)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """Gated weight: x [..., K] bf16 -> silu(gate) * up, [..., N / 2]."""
        assert self.gated, "silu_and_mul needs a weight packed gated"
        return self._apply(x, None, EPILOGUE_GATED_SILU)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None, epilogue: int) -> torch.Tensor:
        y = self._gemm(self._rows_in(x.reshape(-1, self.in_features)), bias, epilogue)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _rows_in(self, rows: torch.Tensor) -> torch.Tensor:
        """x's rows [M, K] as the kernel reads them."""
        return rows.contiguous()

    def _gemm(self, rows: torch.Tensor, bias: torch.Tensor | None, epilogue: int
              ) -> torch.Tensor:
        raise NotImplementedError


class PackedWeight(PackedGemm):
    """A [N, K] bf16 weight in the kernel's panel layout; `linear(x, bias)` applies it.

    `gated`: the weight is [gate; up] (d rows each) and its panels pair 24 gate rows with the
    same 24 up rows, so that `silu_and_mul(x)` = silu(x gate^T) * (x up^T) comes out of the GEMM
    in one pass, bit-equal to `linear` then `cpu_elementwise.silu_and_mul`.
    """

    def __init__(self, weight: torch.Tensor, gated: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.gated = gated
        self.data = _module().gemm_pack(weight, gated)  # [panels, K / 2, 3, 16, 2]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and weight.dim() == 2 and weight.shape[1] % 2 == 0 and available())

    def _gemm(self, rows: torch.Tensor, bias: torch.Tensor | None, epilogue: int
              ) -> torch.Tensor:
        return _module().gemm_linear(rows, self.data, self.out_features, bias, epilogue)


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + length), 2 MB aligned: whether Linux
    took it (THP in "always" or "madvise" mode)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    return madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def empty_in_huge_pages(nbytes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """One buffer of transparent huge pages, not touched yet, and a uint8 view of it per size,
    in order, each 64-byte aligned; None if there is less than a huge page or Linux grants
    none. The first write to a view brings its pages in huge."""
    sizes = [-(-n // 64) * 64 for n in nbytes]
    total = sum(sizes)
    if total < HUGE_PAGE:
        return None
    length = -(-total // HUGE_PAGE) * HUGE_PAGE
    buffer = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)  # not touched yet: no pages
    start = -buffer.data_ptr() % HUGE_PAGE  # the first 2 MB boundary in it
    if not _advise_huge_pages(buffer.data_ptr() + start, length):
        return None
    offsets = accumulate(sizes[:-1], initial=start)
    return buffer, [buffer[o:o + n] for o, n in zip(offsets, nbytes, strict=True)]


def gather_in_huge_pages(weights: list) -> torch.Tensor | None:
    """Move packed weights (anything with a `data` tensor: `PackedWeight`, the quantized
    GEMM's), in order, into one buffer of transparent huge pages: a decode step
    streams every weight from memory, and with 4 KB pages it misses the TLB once per page
    (docs/benchmarks/throughput.md, "Tenth and eleventh runs"). Each weight's `data` becomes a
    view of the buffer, values unchanged; returns the buffer, or None (weights left where they
    are) if there is less than a huge page or Linux grants none."""
    got = empty_in_huge_pages([w.data.numel() * w.data.element_size() for w in weights])
    if got is None:
        return None
    buffer, views = got
    for weight, view in zip(weights, views, strict=True):
        data = weight.data
        weight.data = view.view(data.dtype).view(data.shape)
        weight.data.copy_(data)  # the first touch: the pages come in huge
    return buffer
