"""bf16 GEMM for CPUs with AVX512-BF16: `y = x @ W^T (+ b)` over a weight packed once at load.

The weight [N, K] is repacked into panels of 48 output features, k-pairs interleaved the way
`vdpbf16ps` consumes them (one 64-byte vector = 16 features x 2 consecutive k):

    packed[p, kp, v, j, t] = W[48 p + 16 v + j, 2 kp + t]        (zero past N)

A micro-kernel keeps an 8-row x 48-column tile of float32 sums in 24 registers and walks K two
at a time: 3 vector loads of the panel, 8 broadcasts of x's k-pairs, 24 `vdpbf16ps` (products
exact, sums in float32), then adds the bias and rounds to bf16 once. Threads split (panel,
64-row block) tasks, panel-major, so a thread reuses a panel from L2 across row blocks.

Measured on a 2-core AMD EPYC (Zen 4, AVX512-BF16, no AMX) against oneDNN's prepacked bf16
linear (`benchmarks/gemm.py`): 1.1x at 64 rows, 1.3-1.6x at 1-16 rows, where a decode step streams
every weight from memory (29 GB/s vs oneDNN's 18). Sums run in another order than oneDNN's, so
results differ from `F.linear` in the last bf16 bit of some outputs.

Built on first use like `paged_attention_cpu`; `available()` is False where the CPU or compiler
lacks AVX512-BF16 (the caller then keeps oneDNN or `F.linear`).
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_simd

PANEL = 48  # output features per panel (3 vectors of 16)

SOURCE = r"""
#if defined(ASERVE_AVX512) && defined(__AVX512BF16__)
#define ASERVE_GEMM 1
#endif

constexpr int64_t kVecs = 3, kPanel = 16 * kVecs, kRows = 8, kRowBlock = 64;

bool gemm_supported() {
#ifdef ASERVE_GEMM
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 (K even) -> [panels, K / 2, 3, 16, 2], zero past N.
torch::Tensor gemm_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "gemm_pack: a bf16 [N, K] weight with K even");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, panels = (N + kPanel - 1) / kPanel;
  auto out = torch::zeros({panels, K2, kVecs, 16, 2}, w.options());
  const int32_t* src = reinterpret_cast<const int32_t*>(w.data_ptr());  // k-pairs
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t p = n / kPanel, lane = n % kPanel;  // lane = 16 v + j
      for (int64_t kp = 0; kp < K2; ++kp) dst[(p * K2 + kp) * kPanel + lane] = src[n * K2 + kp];
    }
  });
  return out;
}

#ifdef ASERVE_GEMM
// c[0:R, 0:cols] = a[0:R, :] @ panel (+ bias), R <= 8 rows of a (stride lda), cols <= 48.
template <int R>
static void tile(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel, int64_t K2,
                 at::BFloat16* c, int64_t ldc, int64_t cols, const at::BFloat16* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const int64_t lda32 = lda / 2;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = _mm512_loadu_si512(panel + (kp * kVecs + v) * 32);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(a32[r * lda32 + kp]);
      for (int v = 0; v < kVecs; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)x, (__m512bh)b[v]);
    }
  }
  for (int v = 0; v < kVecs && 16 * v < cols; ++v) {
    const __mmask16 m = tail_mask(cols - 16 * v);
    const __m512 bv = bias != nullptr ? load_bf16(bias + 16 * v, m) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store_bf16(c + r * ldc + 16 * v, _mm512_add_ps(acc[r][v], bv), m);
  }
}

using Tile = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, at::BFloat16*,
                      int64_t, int64_t, const at::BFloat16*);
static const Tile kTiles[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                       tile<5>, tile<6>, tile<7>, tile<8>};
#endif

// y [M, N] = x [M, K] @ W^T (+ bias [N]) for the packed W; x contiguous bf16.
torch::Tensor gemm_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(gemm_supported(), "cpu_gemm.linear: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "cpu_gemm.linear: x must be a contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), K2 = K / 2, panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K2 && packed.size(0) * kPanel >= N, "cpu_gemm.linear: shapes");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 &&
                                    bias->is_contiguous() && bias->numel() == N),
              "cpu_gemm.linear: a contiguous bf16 bias of N values");
  auto y = torch::empty({M, N}, x.options());
#ifdef ASERVE_GEMM
  const at::BFloat16* a = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* c = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / blocks, m0 = (task % blocks) * kRowBlock;
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      const at::BFloat16* panel = w + p * K2 * kPanel * 2;
      for (int64_t m = m0; m < std::min(M, m0 + kRowBlock); m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        kTiles[rows](a + m * K, K, panel, K2, c + m * N + p * kPanel, N, cols,
                     b == nullptr ? nullptr : b + p * kPanel);
      }
    }
  });
#endif
  return y;
}
"""


FUNCTIONS = ["gemm_supported", "gemm_pack", "gemm_linear"]


def _module():
    return cpu_simd.load()


def available() -> bool:
    """Whether this CPU build has the AVX512-BF16 GEMM."""
    module = _module()
    return module is not None and module.gemm_supported()


class PackedWeight:
    """A [N, K] bf16 weight in the kernel's panel layout; `linear(x, bias)` applies it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.data = _module().gemm_pack(weight)  # [panels, K / 2, 3, 16, 2]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and weight.dim() == 2 and weight.shape[1] % 2 == 0 and available())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N]."""
        rows = x.reshape(-1, self.in_features).contiguous()
        y = _module().gemm_linear(rows, self.data, self.out_features, bias)
        return y.view(*x.shape[:-1], self.out_features)
