// qgemm's integer tiles on CPUs with AVX2 but not AVX512-VNNI + BF16 (gemm_avx2.h says which):
// the packed layouts of qlayout.h, every one of them, read 8 outputs a vector. Included by
// qgemm.h ahead of qgemm_linear.
//
// AVX2 has no `vpdpbusd`; `vpmaddubsw` multiplies 32 unsigned weight bytes by 32 signed
// activation bytes and adds adjacent pairs into int16, saturating, and `vpmaddwd` by ones adds
// the pairs of pairs into int32 lanes (4 products an output lane, as `vpdpbusd` sums them).
// Values of 4, 5 and 6 bits cannot saturate: int16 sums of 8, 4 and 2 quads' pairs stay below
// 2^15 (8 x 2 x 15 x 127 = 30,480; 4 x 2 x 31 x 127; 2 x 2 x 63 x 127), so one `vpmaddwd` a
// chunk of that many quads. 8-bit values (up to 255) could: they run as signed bytes w - 128,
// |w - 128| times x carrying w - 128's sign (llama.cpp's sign trick, each pair at most
// 2 x 128 x 127), and the int32 sum gets 128 sum(xq) back, so the integer sums, and from them
// the float epilogue, are the AVX-512 tiles' exactly.
//
// One row (decode) reads a group front to back, all 6 output vectors at once (row_dots_avx2),
// the next block prefetched; two rows walk a group one output vector at a time (their int16
// and int32 sums 2 registers each). The float sums of 48 outputs across groups are acc[R][6];
// the epilogue is gemm_avx2.h's store_sums.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "gemm.h"
#include "qlayout.h"

#if defined(ASERVE_GEMM_AVX2)
#define ASERVE_QGEMM_AVX2 1

// x [M, K] bf16 -> xq int8 [M, K] and per (row, group of G): xs = amax / 127, xsum = xs *
// sum(xq), and isum = sum(xq) (int32): quantize_rows' arithmetic, 8 lanes at a time.
static void quantize_rows_avx2(const at::BFloat16* x, int64_t M, int64_t K, int64_t G,
                               int8_t* xq, float* xs, float* xsum, int32_t* isum) {
  const int64_t groups = K / G, grain = std::max<int64_t>(1, (int64_t{1} << 16) / G);
  auto load = [](const at::BFloat16* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  };
  at::parallel_for(0, M * groups, grain, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t task = begin; task < end; ++task) {
      const at::BFloat16* src = x + task * G;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t k = 0; k < G; k += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load(src + k)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amax);
      const float top = *std::max_element(lanes, lanes + 8);
      const float inv = top > 0.f ? 127.f / top : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = 0; k < G; k += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load(src + k), vinv));
        sum = _mm256_add_epi32(sum, v);
        const __m128i w =
            _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + task * G + k), _mm_packs_epi16(w, w));
      }
      alignas(32) int32_t s[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s), sum);
      int32_t total = 0;
      for (int i = 0; i < 8; ++i) total += s[i];
      const float scale = top / 127.f;
      xs[task] = scale;
      xsum[task] = scale * static_cast<float>(total);
      isum[task] = total;
    }
  });
}

// Quads a unit of the layout holds (8 bits: one; 4 bits: a byte's two; 6 bits: a top byte's 4;
// 5 bits: a top byte's 8) and int16-safe quads a chunk (see above).
template <int Bits>
struct QuadUnit {
  static constexpr int kQuads = Bits == 8 ? 1 : Bits == 4 ? 2 : Bits == 6 ? 4 : 8;
  static constexpr int kChunk = Bits == 8 ? 1 : Bits == 4 ? 8 : Bits == 6 ? 2 : 4;
};

// Quad s of unit u, vector v (8 outputs x 4 inputs), of a group's values at w (G inputs), as
// whole bytes: the nibble, and for 5 / 6 bits the top bits moved to bit 4 (16-bit shifts:
// the AND drops what crosses a byte).
template <int Bits>
static inline __m256i unit_quad(const uint8_t* w, int64_t G, int64_t u, int v, int s) {
  auto at = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  if (Bits == 8) return at(w + (u * kYmms + v) * 32);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i n = at(w + ((u * QuadUnit<Bits>::kQuads + s) / 2 * kYmms + v) * 32);
  const __m256i nib = s % 2 == 0 ? _mm256_and_si256(n, low4)
                                 : _mm256_and_si256(_mm256_srli_epi16(n, 4), low4);
  if (Bits == 4) return nib;
  const __m256i t = at(w + kPanel * G / 2 + (u * kYmms + v) * 32);
  const int bit = Bits == 5 ? s : 2 * s;  // moved to bit 4
  const __m256i moved = bit <= 4 ? _mm256_slli_epi16(t, 4 - bit) : _mm256_srli_epi16(t, bit - 4);
  return _mm256_or_si256(nib, _mm256_and_si256(moved, _mm256_set1_epi8(Bits == 5 ? 0x10 : 0x30)));
}

// The int32 sums dot[r] of one group, output vector v: rows [0, R) of x (stride K, the
// group's G int8 activations; isum their sums) by the group's values at w.
template <int R, int Bits, int FixedG>
static inline __attribute__((always_inline)) void group_dots_avx2(
    const uint8_t* w, const int8_t* x, const int32_t* isum, int64_t groups, int64_t K,
    int64_t group, int v, __m256i (&dot)[R]) {
  using U = QuadUnit<Bits>;
  const int64_t G = FixedG > 0 ? FixedG : group;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i part[R];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    dot[r] = _mm256_setzero_si256(), part[r] = _mm256_setzero_si256();
  ASERVE_UNROLL for (int64_t u = 0; u < G / (4 * U::kQuads); ++u) {
    ASERVE_UNROLL for (int s = 0; s < U::kQuads; ++s) {
      const int64_t kq = u * U::kQuads + s;
      const __m256i q = unit_quad<Bits>(w, G, u, v, s);
      const __m256i qs = Bits == 8 ? _mm256_xor_si256(q, flip) : q;  // 8 bits: signed
      const __m256i qa = Bits == 8 ? _mm256_abs_epi8(qs) : q;
      ASERVE_UNROLL for (int r = 0; r < R; ++r) {
        __m256i xb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 4 * kq));
        if (Bits == 8) xb = _mm256_sign_epi8(xb, qs);
        part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(qa, xb));
      }
      if ((kq + 1) % U::kChunk == 0 || kq + 1 == G / 4) {
        ASERVE_UNROLL for (int r = 0; r < R; ++r) {
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(part[r], ones));
          part[r] = _mm256_setzero_si256();
        }
      }
    }
  }
  if (Bits == 8)  // sum (w - 128) x + 128 sum x
    ASERVE_UNROLL for (int r = 0; r < R; ++r)
      dot[r] = _mm256_add_epi32(dot[r], _mm256_set1_epi32(128 * isum[r * groups]));
}

// One row (decode): the int32 sums dot[v] of one group for all 6 output vectors at once, so
// that the group's bytes are read front to back (a vector at a time over the whole group read
// them 192 bytes apart, which streamed from memory at two thirds of the speed) and each quad
// of x is broadcast once.
template <int Bits, int FixedG>
static inline __attribute__((always_inline)) void row_dots_avx2(
    const uint8_t* w, const int8_t* x, int32_t isum, int64_t group, __m256i (&dot)[kYmms]) {
  using U = QuadUnit<Bits>;
  const int64_t G = FixedG > 0 ? FixedG : group;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i part[kYmms];
  ASERVE_UNROLL for (int v = 0; v < kYmms; ++v)
    dot[v] = _mm256_setzero_si256(), part[v] = _mm256_setzero_si256();
  ASERVE_UNROLL for (int64_t u = 0; u < G / (4 * U::kQuads); ++u) {
    ASERVE_UNROLL for (int s = 0; s < U::kQuads; ++s) {
      const int64_t kq = u * U::kQuads + s;
      const __m256i xb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + 4 * kq));
      ASERVE_UNROLL for (int v = 0; v < kYmms; ++v) {
        const __m256i q = unit_quad<Bits>(w, G, u, v, s);
        if (Bits == 8) {
          const __m256i qs = _mm256_xor_si256(q, flip);
          dot[v] = _mm256_add_epi32(dot[v], _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                _mm256_abs_epi8(qs), _mm256_sign_epi8(xb, qs)),
                                                                ones));
        } else {
          part[v] = _mm256_add_epi16(part[v], _mm256_maddubs_epi16(q, xb));
        }
      }
      if (Bits != 8 && ((kq + 1) % U::kChunk == 0 || kq + 1 == G / 4)) {
        ASERVE_UNROLL for (int v = 0; v < kYmms; ++v) {
          dot[v] = _mm256_add_epi32(dot[v], _mm256_madd_epi16(part[v], ones));
          part[v] = _mm256_setzero_si256();
        }
      }
    }
  }
  if (Bits == 8)
    ASERVE_UNROLL for (int v = 0; v < kYmms; ++v)
      dot[v] = _mm256_add_epi32(dot[v], _mm256_set1_epi32(128 * isum));
}

// sums[0:R, :] = rows [0, R) of x (quantized: xq stride K; xs / xsum / isum stride L.groups)
// @ one packed panel of layout L.
template <int R, int Bits, int FixedG>
static void qtile_avx2(const int8_t* xq, int64_t K, const float* xs, const float* xsum,
                       const int32_t* isum, const uint8_t* panel, const QuantLayout& L,
                       float (*sums)[kPanel]) {
  __m256 acc[R][kYmms];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kYmms; ++v) acc[r][v] = _mm256_setzero_ps();
  const int64_t G = FixedG > 0 ? FixedG : L.group, groups = L.groups;
  const bool sym = L.zero > 0.f, two = L.sub > 1;
  const int64_t head = two ? quant_head_bytes(sym, L.sub) : 0;
  alignas(32) float gs[kSuperBlock / 16][kPanel], gm[kSuperBlock / 16][kPanel];
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* block = panel + b * L.block_bytes;
    for (int64_t line = 0; line < L.block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + L.block_bytes + line), _MM_HINT_T0);
    if (two) {  // the block's groups' float scales (and mins), made once from its tables
      const __m128i* h = reinterpret_cast<const __m128i*>(block);
      const int8_t* subs = reinterpret_cast<const int8_t*>(block + kQuantScales * (sym ? 1 : 2));
      for (int v = 0; v < kYmms; ++v) {
        const __m256 bs = _mm256_cvtph_ps(_mm_loadu_si128(h + v));
        const __m256 bm = sym ? bs : _mm256_cvtph_ps(_mm_loadu_si128(h + kYmms + v));
        for (int64_t j = 0; j < L.sub; ++j) {
          auto times = [&](const int8_t* p, __m256 by) {
            const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v));
            return _mm256_mul_ps(by, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
          };
          _mm256_store_ps(gs[j] + 8 * v, times(subs + j * kPanel, bs));
          if (!sym) _mm256_store_ps(gm[j] + 8 * v, times(subs + (L.sub + j) * kPanel, bm));
        }
      }
    }
    for (int64_t j = 0; j < L.sub; ++j) {
      const int64_t g = b * L.sub + j;
      const uint8_t* w = block + head + j * L.value_bytes;
      const __m128i* h = reinterpret_cast<const __m128i*>(w + L.value_bytes);  // one level
      __m256i row[kYmms];  // one row: every vector's sums at once
      if constexpr (R == 1) row_dots_avx2<Bits, FixedG>(w, xq + g * G, isum[g], G, row);
      ASERVE_UNROLL for (int v = 0; v < kYmms; ++v) {
        __m256i dot[R];
        if constexpr (R == 1) dot[0] = row[v];
        else group_dots_avx2<R, Bits, FixedG>(w, xq + g * G, isum + g, groups, K, G, v, dot);
        const __m256 s = two ? _mm256_load_ps(gs[j] + 8 * v)
                             : _mm256_cvtph_ps(_mm_loadu_si128(h + v));
        __m256 m = s;
        if (!sym)
          m = two ? _mm256_load_ps(gm[j] + 8 * v)
                  : _mm256_cvtph_ps(_mm_loadu_si128(h + kYmms + v));
        ASERVE_UNROLL for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_set1_ps(xs[r * groups + g]);
          const __m256 bsum = _mm256_set1_ps(xsum[r * groups + g]);
          const __m256 d = _mm256_cvtepi32_ps(dot[r]);
          if (sym) {  // scale * (xs dot - zero xsum), as the AVX-512 tiles
            const __m256 t = _mm256_fmadd_ps(d, a, _mm256_mul_ps(_mm256_set1_ps(-L.zero), bsum));
            acc[r][v] = _mm256_fmadd_ps(t, s, acc[r][v]);
          } else {
            const __m256 t = _mm256_mul_ps(d, a);
            acc[r][v] = _mm256_fmadd_ps(m, bsum, _mm256_fmadd_ps(t, s, acc[r][v]));
          }
        }
      }
    }
  }
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kYmms; ++v) _mm256_storeu_ps(sums[r] + 8 * v, acc[r][v]);
}

using QTileAvx2 = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*,
                           const uint8_t*, const QuantLayout&, float (*)[kPanel]);
constexpr int64_t kQRowsAvx2 = 2;  // rows a tile
#define ASERVE_QTILES_AVX2(B, G) {qtile_avx2<1, B, G>, qtile_avx2<2, B, G>}
#define ASERVE_QTILES_AVX2_G(G) \
  {ASERVE_QTILES_AVX2(4, G), ASERVE_QTILES_AVX2(5, G), ASERVE_QTILES_AVX2(6, G), \
   ASERVE_QTILES_AVX2(8, G)}
// [group: any, 16, 32][bits: 4, 5, 6, 8][rows - 1] (5 bits: groups of 32 alone, which the
// layout checks; the others are never called)
static const QTileAvx2 kQTilesAvx2[3][4][kQRowsAvx2] = {
    ASERVE_QTILES_AVX2_G(0), ASERVE_QTILES_AVX2_G(16), ASERVE_QTILES_AVX2_G(32)};
#undef ASERVE_QTILES_AVX2_G
#undef ASERVE_QTILES_AVX2

// A task's rows [0, rows) (x quantized, at its row 0) @ one panel into c, by epilogue.
static void qpanel_rows_avx2(const QuantLayout& L, int epilogue, const uint8_t* panel,
                             const int8_t* xq, int64_t K, const float* xs, const float* xsum,
                             const int32_t* isum, int64_t rows, char* c, int64_t ldc,
                             int64_t item, int64_t cols, const TileEpilogue& ep) {
  const int fixed = L.group == 16 ? 1 : L.group == 32 ? 2 : 0;
  const QTileAvx2* tiles = kQTilesAvx2[fixed][L.bits == 8 ? 3 : L.bits - 4];
  alignas(32) float sums[kQRowsAvx2][kPanel];
  for (int64_t m = 0; m < rows; m += kQRowsAvx2) {
    const int64_t n = std::min(kQRowsAvx2, rows - m), o = m * L.groups;
    tiles[n - 1](xq + m * K, K, xs + o, xsum + o, isum + o, panel, L, sums);
    store_sums(epilogue, sums, n, c + m * ldc * item, ldc, cols, ep);
  }
}
#endif
