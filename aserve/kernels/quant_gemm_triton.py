"""Weight-only int4 / int8 GEMM in Triton (CUDA and ROCm): y = x W^T (+ b) for a weight kept
in its integer form (`quantization.int_weights.IntWeight`: W[n, k] = scale * q + min per group
of G inputs), W4A16 / W8A16: activations stay in their float dtype, the weight is dequantized
tile by tile in registers and never exists in float in memory.

    layout (`TritonQuantWeight`):  q      uint8 [N, K / 2] (4 bits: even k in the low nibble,
                                          odd k in the high one) or [N, K] (8 bits)
                                   scale  float16 [N, K / G]      min  float16 [N, K / G]

Each program computes a BLOCK_M x BLOCK_N tile of y over K in BLOCK_K steps: it loads the
[BLOCK_N, BLOCK_K] codes, their groups' scales and mins, makes the weight tile in float32,
casts it to x's dtype and accumulates `tl.dot` in float32; the bias is added at the end. The
torch twin is `reference` (the weight dequantized with the same fp16 scales, then F.linear in
float32). On CPU the tests run it under the Triton interpreter (`TRITON_INTERPRET=1`); tile sizes
are not tuned on a device yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.kernels.triton_utils import is_interpreted, require_triton
from aserve.quantization.int_weights import IntWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the launcher says what is missing
    triton = None

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                  torch.bfloat16: tl.bfloat16}

    @triton.jit
    def _quant_gemm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm,
                           stride_qn, stride_sn, stride_ym, BITS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_DTYPE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = col_ok[:, None] & k_ok[None, :]  # [BLOCK_N, BLOCK_K]
            w_rows = cols[:, None].to(tl.int64)
            if BITS == 4:
                byte = tl.load(q_ptr + w_rows * stride_qn + (k // 2)[None, :], mask=w_mask,
                               other=0)
                code = (byte >> ((k % 2) * 4)[None, :]) & 0xF
            else:
                code = tl.load(q_ptr + w_rows * stride_qn + k[None, :], mask=w_mask, other=0)
            group = (k // G)[None, :]
            scale = tl.load(s_ptr + w_rows * stride_sn + group, mask=w_mask, other=0.0)
            low = tl.load(m_ptr + w_rows * stride_sn + group, mask=w_mask, other=0.0)
            w = code.to(tl.float32) * scale.to(tl.float32) + low.to(tl.float32)
            acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
else:
    _quant_gemm_kernel = None


class TritonQuantWeight:
    """An integer weight in the Triton GEMM's layout (module docstring), on the device of
    `device`; `linear`, `linear_float` and `rows` as the CPU's packed weights have them."""

    gated = False

    def __init__(self, weight: IntWeight, device: torch.device | str) -> None:
        self.out_features, self.in_features = weight.shape
        self.group, self.bits = weight.group, 4 if weight.bits <= 4 else 8
        q = weight.q
        if self.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.q = q.contiguous().to(device)
        self.scale = weight.scale.half().contiguous().to(device)
        self.min = weight.min.half().contiguous().to(device)

    @staticmethod
    def supports(weight: IntWeight) -> bool:
        rows, cols = weight.shape
        return (weight.perm is None and cols % weight.group == 0 and cols % 2 == 0 and rows > 0
                and bool(torch.isfinite(weight.scale.half()).all())
                and bool(torch.isfinite(weight.min.half()).all()))

    @property
    def quantization(self) -> str:
        return f"int{self.bits} g{self.group}"

    def int_weight(self) -> IntWeight:
        """The weight as stored (fp16 scales and mins), on the host."""
        q = self.q.cpu()
        if self.bits == 4:
            q = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(self.out_features, -1)
        return IntWeight(q, self.scale.cpu().float(), self.min.cpu().float(), self.group,
                         self.bits)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_gemm_triton(x, self, bias)

    def linear_float(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_gemm_triton(x, self, bias, out_dtype=torch.float32)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a Triton quantized weight is never packed gated")

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of the weight, float32 (a quantized embedding's lookup)."""
        index = index.reshape(-1).long()
        q = self.q[index]
        if self.bits == 4:
            q = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(len(index), -1)
        scale = self.scale[index].float().repeat_interleave(self.group, dim=1)
        low = self.min[index].float().repeat_interleave(self.group, dim=1)
        return q.float() * scale + low


def _block_sizes(rows: int) -> tuple[int, int, int]:
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return block_m, 64, 64


def quant_gemm_triton(x: torch.Tensor, weight: TritonQuantWeight,
                      bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] -> x W^T (+ bias) [..., N] in `out_dtype` (default x's)."""
    require_triton("quant_gemm_triton", _quant_gemm_kernel, x, weight.q)
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.out_features
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m > 0:
        block_m, block_n, block_k = _block_sizes(m)
        # the interpreter's bfloat16 dot is wrong (see is_interpreted)
        dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16
                                                and is_interpreted(_quant_gemm_kernel))
        b = weight.scale if bias is None else bias  # a stand-in pointer, never read
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _quant_gemm_kernel[grid](
            rows, weight.q, weight.scale, weight.min, b, y, m, n, weight.in_features,
            weight.group, rows.stride(0), weight.q.stride(0), weight.scale.stride(0),
            y.stride(0), BITS=weight.bits, HAS_BIAS=bias is not None, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_DTYPE=tl.float32 if dot_fp32 else _TL_DTYPES[x.dtype])
    return y.view(*x.shape[:-1], n)


def reference(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The twin: the weight dequantized with fp16 scales and mins, F.linear in float32."""
    w = IntWeight(weight.q, weight.scale.half().float(), weight.min.half().float(),
                  weight.group, weight.bits).dequantize()
    return F.linear(x.float(), w, None if bias is None else bias.float())
