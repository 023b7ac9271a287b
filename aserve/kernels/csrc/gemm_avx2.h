// The packed GEMMs on CPUs with AVX2 but no AVX512-BF16 (AMD Zen 2 and 3, Intel before
// Sapphire Rapids' bf16): the same packed panels as gemm.h's and qgemm.h's AVX-512 tiles, read
// by 8-wide tiles (a panel's 48 outputs are 6 vectors of 8), so that a bf16 or quantized model
// keeps one packed form whatever the host. Included by gemm.h ahead of gemm_linear; qgemm's
// integer tiles are qgemm_avx2.h.
//
// bf16: a panel's 32-byte run holds 8 outputs x one k-pair (bf16 words, even k low): the even
// k's values are the int32 lanes shifted up 16, the odd k's the lanes with the low half
// cleared, each exact in float32, so a k-pair costs 2 FMAs a vector (`vdpbf16ps` does both in
// one). One row (decode) keeps the 6 vectors' sums in registers; 2 rows take half a panel at a
// time (3 vectors, two passes; the second reads the panel from L2).
//
// The epilogues run on the tile's float sums in a buffer, one value at a time (48 R values
// after 48 R K products): bias, one bf16 rounding, activation.h's scalar gated activations,
// the same arithmetic as gemm.h's store_tile.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "activation.h"

#if !defined(ASERVE_GEMM) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ASERVE_GEMM_AVX2 1
#include <immintrin.h>

constexpr int kYmms = kPanel / 8;  // 8-wide vectors a panel

// The R x 48 float sums of a tile (a gated panel's lanes as panel_lane lays them) into `out`
// by epilogue E, as store_tile does: kPlain / kPlainFloat columns [0, cols) + bias, rounded to
// bf16 (stored as float32 for kPlainFloat); gated: gate and up (+ their biases) rounded to bf16,
// then both stored (kGatedSplit, up at column d) or bf16(act(gate, up)).
static void store_sums(int epilogue, const float (*sums)[kPanel], int64_t R, void* out,
                       int64_t ldc, int64_t cols, const TileEpilogue& ep) {
  const at::BFloat16* bias = ep.bias;
  for (int64_t r = 0; r < R; ++r) {
    const float* s = sums[r];
    if (epilogue == kPlain || epilogue == kPlainFloat) {
      for (int64_t o = 0; o < cols; ++o) {
        const float y = bias == nullptr ? s[o] : s[o] + static_cast<float>(bias[o]);
        if (epilogue == kPlain)
          static_cast<at::BFloat16*>(out)[r * ldc + o] = at::BFloat16(y);
        else
          static_cast<float*>(out)[r * ldc + o] = round_bf16(y);
      }
      continue;
    }
    at::BFloat16* row = static_cast<at::BFloat16*>(out) + r * ldc;
    for (int64_t o = 0; o < cols; ++o) {
      // gate 0..15 in lanes 0..15, up's in 16..31; gate 16..23 in 32..39, up's in 40..47
      const int64_t gate = o < 16 ? o : 16 + o, up = o < 16 ? 16 + o : 24 + o;
      float g = s[gate], u = s[up];
      if (bias != nullptr)
        g += static_cast<float>(bias[o]), u += static_cast<float>(bias[ep.d + o]);
      g = round_bf16(g), u = round_bf16(u);
      if (epilogue == kGatedSplit) {
        row[o] = at::BFloat16(g), row[ep.d + o] = at::BFloat16(u);
      } else if (epilogue == kGatedSilu) {
        row[o] = at::BFloat16(SiluMul{}(g, u));
      } else if (epilogue == kGatedGelu) {
        row[o] = at::BFloat16(GeluTanhMul{}(g, u));
      } else {
        row[o] = at::BFloat16(ep.swiglu(g, u));
      }
    }
  }
}

// sums[0:R, 8 v0 : 8 (v0 + V)] = a[0:R, :] (stride lda) @ vectors [v0, v0 + V) of a bf16 panel.
template <int R, int V>
static inline void bf16_tile_avx2(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel,
                                  int64_t K2, int v0, float (*sums)[kPanel]) {
  __m256 acc[R][V];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const char* w = reinterpret_cast<const char*>(panel) + 32 * v0;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m256 even[R], odd[R];  // x's k-pair kp, each value in every lane
    ASERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(a32[r * (lda / 2) + kp]);
      even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      odd[r] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    }
    ASERVE_UNROLL for (int v = 0; v < V; ++v) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(b, high));
      ASERVE_UNROLL for (int r = 0; r < R; ++r)
        acc[r][v] = _mm256_fmadd_ps(hi, odd[r], _mm256_fmadd_ps(lo, even[r], acc[r][v]));
    }
    w += kPanel * 4;  // a k-pair's 48 outputs x 2 bf16
  }
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums[r] + 8 * (v0 + v), acc[r][v]);
}

// c[0:M, 0:cols] = a[0:M, :] (stride K) @ one bf16 panel, by epilogue: one row a whole panel
// at a time, pairs of rows half a panel at a time.
static void bf16_panel_rows_avx2(int epilogue, const at::BFloat16* a, int64_t M, int64_t K,
                                 const at::BFloat16* panel, char* c, int64_t ldc, int64_t item,
                                 int64_t cols, const TileEpilogue& ep) {
  alignas(32) float sums[2][kPanel];
  for (int64_t m = 0; m < M; m += 2) {
    const at::BFloat16* x = a + m * K;
    const int64_t rows = std::min<int64_t>(2, M - m);
    if (rows == 1) {
      bf16_tile_avx2<1, kYmms>(x, K, panel, K / 2, 0, sums);
    } else {
      bf16_tile_avx2<2, kYmms / 2>(x, K, panel, K / 2, 0, sums);
      bf16_tile_avx2<2, kYmms / 2>(x, K, panel, K / 2, kYmms / 2, sums);
    }
    store_sums(epilogue, sums, rows, c + m * ldc * item, ldc, cols, ep);
  }
}
#endif
