// The packed GEMMs on CPUs with AVX2 but no AVX512-BF16 (AMD Zen 2 and 3, Intel before
// Sapphire Rapids' bf16): the same packed panels as gemm.h's and qgemm.h's AVX-512 tiles, read
// by 8-wide tiles (a panel's 48 outputs are 6 vectors of 8), so that a bf16 or quantized model
// keeps one packed form whatever the host. Included by gemm.h ahead of gemm_linear; qgemm's
// integer tiles are qgemm_avx2.h.
//
// bf16: a panel's 32-byte run holds 8 outputs x one k-pair (bf16 words, even k low): the even
// k's values are the int32 lanes shifted up 16, the odd k's the lanes with the low half
// cleared, each exact in float32, so a k-pair costs 2 FMAs a vector (`vdpbf16ps` does both in
// one). One row (decode) keeps the 6 vectors' sums in registers; 4 rows take a third of a
// panel at a time (three passes, the panel in L1 after the first), a last pair half of it.
//
// The epilogues run on the tile's float sums in a buffer (48 R values after 48 R K
// products), 8 outputs at a time: bias, one bf16 rounding, silu by exp8 (activation.h), the
// same arithmetic as gemm.h's store_tile; GELU, SwiGLU and a tail one value at a time.
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

// Gated panels' lanes (panel_lane): outputs 8 j .. 8 j + 7 have their gate sums at
// kGateAt[j] and their up sums at kUpAt[j].
constexpr int kGateAt[3] = {0, 8, 32}, kUpAt[3] = {16, 24, 40};

// The R x 48 float sums of a tile (a gated panel's lanes as panel_lane lays them) into `out`
// by epilogue E, as store_tile does: kPlain / kPlainFloat columns [0, cols) + bias, rounded to
// bf16 (stored as float32 for kPlainFloat); gated: gate and up (+ their biases) rounded to bf16,
// then both stored (kGatedSplit, up at column d) or bf16(act(gate, up)). Whole vectors of 8
// outputs go 8 lanes at a time (silu by SiluMul's 8-lane form, a gate under kSiluExact8 by
// the scalar one); a tail, GELU and SwiGLU one value at a time, the same arithmetic.
static void store_sums(int epilogue, const float (*sums)[kPanel], int64_t R, void* out,
                       int64_t ldc, int64_t cols, const TileEpilogue& ep) {
  const at::BFloat16* bias = ep.bias;
  const int64_t whole = epilogue == kGatedGelu || epilogue == kGatedSwiglu ? 0 : cols / 8 * 8;
  for (int64_t r = 0; r < R; ++r) {
    const float* s = sums[r];
    if (epilogue == kPlain || epilogue == kPlainFloat) {
      for (int64_t o = 0; o < whole; o += 8) {
        __m256 y = _mm256_loadu_ps(s + o);
        if (bias != nullptr) y = _mm256_add_ps(y, load8_bf16(bias + o));
        if (epilogue == kPlain)
          store8_bf16(static_cast<at::BFloat16*>(out) + r * ldc + o, y);
        else
          _mm256_storeu_ps(static_cast<float*>(out) + r * ldc + o, round8_bf16(y));
      }
      for (int64_t o = whole; o < cols; ++o) {
        const float y = bias == nullptr ? s[o] : s[o] + static_cast<float>(bias[o]);
        if (epilogue == kPlain)
          static_cast<at::BFloat16*>(out)[r * ldc + o] = at::BFloat16(y);
        else
          static_cast<float*>(out)[r * ldc + o] = round_bf16(y);
      }
      continue;
    }
    at::BFloat16* row = static_cast<at::BFloat16*>(out) + r * ldc;
    int64_t o = 0;
    for (; o < whole; o += 8) {
      __m256 g = _mm256_loadu_ps(s + kGateAt[o / 8]), u = _mm256_loadu_ps(s + kUpAt[o / 8]);
      if (bias != nullptr)
        g = _mm256_add_ps(g, load8_bf16(bias + o)), u = _mm256_add_ps(u, load8_bf16(bias + ep.d + o));
      g = round8_bf16(g), u = round8_bf16(u);
      if (epilogue == kGatedSplit) {
        store8_bf16(row + o, g), store8_bf16(row + ep.d + o, u);
      } else if (!_mm256_movemask_ps(_mm256_cmp_ps(g, _mm256_set1_ps(kSiluExact8), _CMP_LT_OQ))) {
        store8_bf16(row + o, SiluMul{}(g, u));
      } else {
        break;  // this vector and the rest one value at a time
      }
    }
    for (; o < cols; ++o) {
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

// A pass that reads only some of each k-pair's 192 bytes (the 4-row tiles' thirds, the pairs'
// halves) leaves the hardware prefetcher a strided walk. So the first pass over a panel
// (Fetch) fetches whole k-pair runs kAvx2Ahead k-pairs ahead, for itself and for the passes
// and row groups after it, which then find them in cache; past a panel's end they fetch the
// next one's start (panels are contiguous; prefetches do not fault).
// smol's step weights at 8 rows (`studies/gemm.py`, Zen 3, medians of 5): 50.2 -> 44.1 ms.
constexpr int64_t kAvx2Ahead = 32;  // k-pairs: 6 KB ahead

template <bool Fetch>
static inline void fetch_pair(const char* w) {
  if (Fetch) {
    ASERVE_UNROLL for (int i = 0; i < kPanel * 4; i += 64)
      _mm_prefetch(w + kAvx2Ahead * kPanel * 4 + i, _MM_HINT_T0);
  }
}

// sums[0:R, 8 v0 : 8 (v0 + V)] = a[0:R, :] (stride lda) @ vectors [v0, v0 + V) of a bf16 panel,
// each k-pair of a row made float by a shift and an AND (one row: no row is used twice).
template <int R, int V, bool Fetch = false>
static inline void bf16_tile_avx2(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel,
                                  int64_t K2, int v0, float (*sums)[kPanel]) {
  __m256 acc[R][V];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const char* w = reinterpret_cast<const char*>(panel) + 32 * v0;
  for (int64_t kp = 0; kp < K2; ++kp) {
    fetch_pair<Fetch>(w);
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

// The same for rows that share the panel: a k-pair's V panel vectors are made float first,
// then each row's pair is broadcast and meets all of them (registers: R V sums, 2 V panel
// values, 2 of x, so R = 4 takes V = 2: three passes over a panel that stays in L1; 8 sums,
// each taking two dependent FMAs a k-pair, just cover the FMA latency).
template <int R, int V, bool Fetch = false>
static inline void bf16_rows_tile_avx2(const at::BFloat16* a, int64_t lda,
                                       const at::BFloat16* panel, int64_t K2, int v0,
                                       float (*sums)[kPanel]) {
  __m256 acc[R][V];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const char* w = reinterpret_cast<const char*>(panel) + 32 * v0;
  for (int64_t kp = 0; kp < K2; ++kp) {
    fetch_pair<Fetch>(w);
    __m256 lo[V], hi[V];
    ASERVE_UNROLL for (int v = 0; v < V; ++v) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      lo[v] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
      hi[v] = _mm256_castsi256_ps(_mm256_and_si256(b, high));
    }
    ASERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(a32[r * (lda / 2) + kp]);
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(x, high));
      ASERVE_UNROLL for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(hi[v], odd, _mm256_fmadd_ps(lo[v], even, acc[r][v]));
    }
    w += kPanel * 4;
  }
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums[r] + 8 * (v0 + v), acc[r][v]);
}

// c[0:M, 0:cols] = a[0:M, :] (stride K) @ one bf16 panel, by epilogue: 4 rows at a time a third
// of the panel a pass (bf16_rows_tile_avx2), then a pair half a panel at a time, a last row
// the whole panel at once (bf16_tile_avx2: for so few rows the rows' pairs stay in registers).
// Single-threaded, 256 rows of the tiny128 shapes: 4 rows at a time ~5 % faster than pairs.
static void bf16_panel_rows_avx2(int epilogue, const at::BFloat16* a, int64_t M, int64_t K,
                                 const at::BFloat16* panel, char* c, int64_t ldc, int64_t item,
                                 int64_t cols, const TileEpilogue& ep) {
  alignas(32) float sums[4][kPanel];
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    if (m == 0)  // (the first pass: v0 = 0, w at the k-pair's start)
      bf16_rows_tile_avx2<4, 2, true>(a, K, panel, K / 2, 0, sums);
    else
      bf16_rows_tile_avx2<4, 2>(a + m * K, K, panel, K / 2, 0, sums);
    ASERVE_UNROLL for (int v0 = 2; v0 < kYmms; v0 += 2)
      bf16_rows_tile_avx2<4, 2>(a + m * K, K, panel, K / 2, v0, sums);
    store_sums(epilogue, sums, 4, c + m * ldc * item, ldc, cols, ep);
  }
  for (; m < M; m += 2) {
    const at::BFloat16* x = a + m * K;
    const int64_t rows = std::min<int64_t>(2, M - m);
    if (rows == 1) {
      bf16_tile_avx2<1, kYmms>(x, K, panel, K / 2, 0, sums);
    } else {
      if (m == 0)
        bf16_tile_avx2<2, kYmms / 2, true>(x, K, panel, K / 2, 0, sums);
      else
        bf16_tile_avx2<2, kYmms / 2>(x, K, panel, K / 2, 0, sums);
      bf16_tile_avx2<2, kYmms / 2>(x, K, panel, K / 2, kYmms / 2, sums);
    }
    store_sums(epilogue, sums, rows, c + m * ldc * item, ldc, cols, ep);
  }
}
#endif
