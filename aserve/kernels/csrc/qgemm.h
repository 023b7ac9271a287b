// Weight-only int8 / int6 / int5 / int4 GEMM for CPUs with AVX512-VNNI: y = x @ W^T (+ b) where
// W is stored as unsigned integers with a scale and a min per group of G inputs (the C++ of
// aserve/kernels/cpu_qgemm.py, whose `reference` is its torch twin):
//
//   W[n, k] = scale[n, g] * q[n, k] + min[n, g]        g = k / G,  0 <= q < 2^bits
//
// which holds every GGUF quant type (Q4_0: min = -8 scale; Q6_K: groups of 16, min = -32 scale;
// Q4_K: its sub-block scales and mins), AWQ and GPTQ (min = -scale * zero) exactly.
//
// Activations are quantized per row and group to int8 as the GEMM starts (llama.cpp's and
// vLLM's W8A8 way): xq = round(x * 127 / amax), xs = amax / 127, so that per group
//
//   sum_k x[k] W[n, k] ~= xs * (scale[n] * sum_k xq[k] q[n, k] + min[n] * sum_k xq[k])
//
// and the inner sum is exact int32 arithmetic: `vpdpbusd` multiplies 4 unsigned weight bytes by
// 4 signed activation bytes and adds them into one int32 lane, 64 products an instruction (twice
// `vdpbf16ps`'s), and an int4 weight costs one AND (and a shift) per 128 values to unpack.
//
// The packed layout (panels of 48 outputs; one level of scales a group, or GGUF's K-quants' two
// levels) is qlayout.h's. The micro-kernel keeps 4 rows x 48 outputs of int32
// sums for a group and of float sums across groups (24 registers), and stores through gemm.h's
// store_tile, so bias, bf16 rounding and the gated SiLU epilogue are the bf16 GEMM's. With one
// or two rows (decode), int4's high nibbles go into sums of their own as they lie (16 q), so
// no shift a vector; GGUF's groups (16, 32) have their k-loops unrolled whole.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "gemm.h"
#include "qlayout.h"

#if defined(ASERVE_GEMM) && defined(__AVX512VNNI__)
#define ASERVE_QGEMM 1
#endif

constexpr int64_t kQRows = 4;  // rows of a micro-kernel tile

bool qgemm_supported() {
#ifdef ASERVE_QGEMM
  return true;
#else
  return false;
#endif
}

#ifdef ASERVE_QGEMM

// x [M, K] bf16 -> xq int8 [M, K], and per (row, group of G): xs = amax / 127 and
// xsum = xs * sum(xq) (float32 [M, K / G]). xq = round-half-even(x * (127 / amax)), 0 where
// amax is 0: cpu_qgemm.quantize_activations computes the same, bit for bit.
static void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t G, int8_t* xq,
                          float* xs, float* xsum) {
  // a decode step's few rows in the calling thread: a parallel region costs more than they do
  const int64_t groups = K / G, grain = std::max<int64_t>(1, (int64_t{1} << 16) / G);
  at::parallel_for(0, M * groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const at::BFloat16* src = x + task * G;  // (row, group) = divmod(task, groups)
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < G; k += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(src + k)));
      const float top = _mm512_reduce_max_ps(amax);
      const float inv = top > 0.f ? 127.f / top : 0.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = 0; k < G; k += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(src + k), vinv));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + task * G + k), _mm512_cvtsepi32_epi8(v));
      }
      const float scale = top / 127.f;
      xs[task] = scale;
      xsum[task] = scale * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  });
}

// Bit s of each byte of t at bit 4, and bit s + 1 at bit 5 (other bits left for an AND with
// 0x10 or 0x30 to clear): 16-bit shifts, which move neither across a byte (s <= 4 left by
// 4 - s, else right by s - 4).
static inline __m512i fifth_bit(__m512i t, int s) {
  return s <= 4 ? _mm512_slli_epi16(t, 4 - s) : _mm512_srli_epi16(t, s - 4);
}

// Quad s of 32 inputs (5 bits) made a whole byte, nibble | fifth bit << 4: the nibble from n
// (its low half for an even s, its high half for an odd one), the fifth bit bit s of t.
static inline __m512i five_bit_quad(__m512i n, __m512i t, int s) {
  const __m512i low = _mm512_and_si512(s % 2 == 0 ? n : _mm512_srli_epi16(n, 4),
                                       _mm512_set1_epi8(0x0F));
  return _mm512_or_si512(low, _mm512_and_si512(fifth_bit(t, s), _mm512_set1_epi8(0x10)));
}

// The four quads of 16 inputs (6 bits: nibbles n0 = quads 0 | 1 << 4, n1 = quads 2 | 3 << 4,
// top bits t) made whole bytes, nibble | top << 4: the top bits split once into pairs (t &
// 0x33, t & 0xCC) shifted so that bits 6-7 of each byte come out 0, then a bit select (low
// nibble from n, the rest from the top bits) a quad: 11 operations for 4 vectors, not 17.
static inline void six_bit_quads(__m512i n0, __m512i n1, __m512i t, __m512i (&q)[4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i even = _mm512_and_si512(t, _mm512_set1_epi8(0x33));  // quads 0 and 2's bits
  const __m512i odd = _mm512_and_si512(t, _mm512_set1_epi8(static_cast<char>(0xCC)));
  constexpr int kSelect = 0xCA;  // a ? b : c, bit by bit
  q[0] = _mm512_ternarylogic_epi32(low4, n0, _mm512_slli_epi16(even, 4), kSelect);
  q[1] = _mm512_ternarylogic_epi32(low4, _mm512_srli_epi16(n0, 4), _mm512_slli_epi16(odd, 2),
                                   kSelect);
  q[2] = _mm512_ternarylogic_epi32(low4, n1, even, kSelect);
  q[3] = _mm512_ternarylogic_epi32(low4, _mm512_srli_epi16(n1, 4), _mm512_srli_epi16(odd, 2),
                                   kSelect);
}

// The int32 sums dot[r][v] of one group: rows [0, R) of x (stride K, the group's G int8
// activations) by its 48 outputs' values at w (the group's bytes in the layout of Bits).
// FixedG: G known, so that the k-loops unroll whole (0: G as given).
template <int R, int Bits, int FixedG>
static inline __attribute__((always_inline)) void group_dots(const uint8_t* w, const int8_t* x,
                                                             int64_t K, int64_t group,
                                                             __m512i (&dot)[R][kVecs]) {
  const int64_t G = FixedG > 0 ? FixedG : group;
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) dot[r][v] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if (Bits == 5 && R > 2) {
    // many rows: each quad made whole once (nibble | 16 h), then one dot a row, as for 6 bits
    const uint8_t* top = w + kPanel * G / 2;
    ASERVE_UNROLL for (int64_t k32 = 0; k32 < G / 32; ++k32) {
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512i t = _mm512_loadu_si512(top + (k32 * kVecs + v) * 64);
        ASERVE_UNROLL for (int i = 0; i < 4; ++i) {  // nibble bytes k8 = 4 k32 + i: quads 2i, 2i+1
          const __m512i n = _mm512_loadu_si512(w + ((4 * k32 + i) * kVecs + v) * 64);
          const __m512i q0 = five_bit_quad(n, t, 2 * i), q1 = five_bit_quad(n, t, 2 * i + 1);
          ASERVE_UNROLL for (int r = 0; r < R; ++r) {
            const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + 32 * k32);
            dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], q0, _mm512_set1_epi32(xr[2 * i]));
            dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], q1, _mm512_set1_epi32(xr[2 * i + 1]));
          }
        }
      }
    }
  } else if (Bits == 6 && R > 2) {
    // many rows: each quad of inputs made whole once (nibble | 16 h, as in the 8-bit
    // layout) and then one dot a row, rather than two (the nibbles', the top bits')
    const uint8_t* top = w + kPanel * G / 2;
    ASERVE_UNROLL for (int64_t k16 = 0; k16 < G / 16; ++k16) {
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512i n0 = _mm512_loadu_si512(w + (2 * k16 * kVecs + v) * 64);
        const __m512i n1 = _mm512_loadu_si512(w + ((2 * k16 + 1) * kVecs + v) * 64);
        __m512i q[4];
        six_bit_quads(n0, n1, _mm512_loadu_si512(top + (k16 * kVecs + v) * 64), q);
        ASERVE_UNROLL for (int r = 0; r < R; ++r) {
          const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + 16 * k16);
          ASERVE_UNROLL for (int sub = 0; sub < 4; ++sub)
            dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], q[sub], _mm512_set1_epi32(xr[sub]));
        }
      }
    }
  } else if (Bits == 8) {
    ASERVE_UNROLL for (int64_t kq = 0; kq < G / 4; ++kq) {
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512i b = _mm512_loadu_si512(w + (kq * kVecs + v) * 64);
        ASERVE_UNROLL for (int r = 0; r < R; ++r) {
          const __m512i a =
              _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 4 * kq));
          dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], b, a);
        }
      }
    }
  } else if (R <= 2) {  // (4, 5 or 6 bits: the low nibbles)
    // few rows: the high nibbles as they lie (16 q), into sums of their own, so no shift a
    // vector and two independent chains; 16 * sum is exact in int32 and shifted back once
    __m512i high[R][kVecs];
    ASERVE_UNROLL for (int r = 0; r < R; ++r)
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) high[r][v] = _mm512_setzero_si512();
    const __m512i high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
    ASERVE_UNROLL for (int64_t k8 = 0; k8 < G / 8; ++k8) {
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512i raw = _mm512_loadu_si512(w + (k8 * kVecs + v) * 64);
        const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(raw, high4);
        ASERVE_UNROLL for (int r = 0; r < R; ++r) {
          const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + 8 * k8);
          dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], lo, _mm512_set1_epi32(xr[0]));
          high[r][v] = _mm512_dpbusd_epi32(high[r][v], hi, _mm512_set1_epi32(xr[1]));
        }
      }
    }
    ASERVE_UNROLL for (int r = 0; r < R; ++r)
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v)
        dot[r][v] = _mm512_add_epi32(dot[r][v], _mm512_srai_epi32(high[r][v], 4));
  } else {  // (4 bits)
    ASERVE_UNROLL for (int64_t k8 = 0; k8 < G / 8; ++k8) {
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512i raw = _mm512_loadu_si512(w + (k8 * kVecs + v) * 64);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        ASERVE_UNROLL for (int r = 0; r < R; ++r) {
          const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + 8 * k8);
          dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], lo, _mm512_set1_epi32(xr[0]));
          dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], hi, _mm512_set1_epi32(xr[1]));
        }
      }
    }
  }
  if ((Bits == 5 || Bits == 6) && R <= 2) {
    // q = nibble + 16 h: the top bits of quad s moved to bit 4 (5 bits) or bits 4-5 (6 bits)
    // of its byte (16 h, unsigned), so their products add into the nibbles' sums as they are;
    // one 16-bit shift and an AND a part. A top byte covers 32 inputs (5 bits) or 16 (6 bits).
    constexpr int64_t kSpan = Bits == 5 ? 32 : 16, kQuads = kSpan / 4;
    const uint8_t* top = w + kPanel * G / 2;
    const __m512i mask = _mm512_set1_epi8(Bits == 5 ? 0x10 : 0x30);
    ASERVE_UNROLL for (int64_t kt = 0; kt < G / kSpan; ++kt) {
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512i raw = _mm512_loadu_si512(top + (kt * kVecs + v) * 64);
        ASERVE_UNROLL for (int sub = 0; sub < kQuads; ++sub) {
          // bit s (5 bits) or bits 2s, 2s + 1 (6 bits) of each byte at bit 4
          const __m512i part = _mm512_and_si512(fifth_bit(raw, Bits == 5 ? sub : 2 * sub), mask);
          ASERVE_UNROLL for (int r = 0; r < R; ++r) {
            const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + kSpan * kt);
            dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], part, _mm512_set1_epi32(xr[sub]));
          }
        }
      }
    }
  }
}

// 48 int8 sub-scales (or sub-mins) at p times a block's float scales: a group's, two levels.
static inline __m512 sub_times(const int8_t* p, int v, __m512 block) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v));
  return _mm512_mul_ps(block, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
}

// Two levels: a block's float scales (and mins) of its groups, gs[j][v] / gm[j][v], made at
// once from the tables ahead of its values: read in the middle of the block's values instead,
// they break its front-to-back stream, and from memory the tile ran at half its speed.
template <int FixedG>
static inline __attribute__((always_inline)) void block_scales(
    const uint8_t* block, const QuantLayout& L, __m512 (&gs)[kSuperBlock / FixedG][kVecs],
    __m512 (&gm)[kSuperBlock / FixedG][kVecs]) {
  constexpr int64_t kSubs = kSuperBlock / FixedG;
  const bool sym = L.zero > 0.f;
  const __m256i* h = reinterpret_cast<const __m256i*>(block);
  const int8_t* subs = reinterpret_cast<const int8_t*>(block + kQuantScales * (sym ? 1 : 2));
  ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
    const __m512 bs = _mm512_cvtph_ps(_mm256_loadu_si256(h + v));
    const __m512 bm = sym ? bs : _mm512_cvtph_ps(_mm256_loadu_si256(h + kVecs + v));
    ASERVE_UNROLL for (int64_t j = 0; j < kSubs; ++j) {
      gs[j][v] = sub_times(subs + j * kPanel, v, bs);
      if (!sym) gm[j][v] = sub_times(subs + (kSubs + j) * kPanel, v, bm);
    }
  }
}

// acc[R][kVecs] += rows [0, R) of x (quantized: xq with stride K, xs / xsum with stride
// L.groups) @ block b of a panel (at `block`); two levels: its groups' scales gs / gm.
template <int R, int Bits, int FixedG, bool Two>
static inline __attribute__((always_inline)) void block_sums(
    __m512 (&acc)[R][kVecs], const uint8_t* block, int64_t b, const QuantLayout& L,
    const int8_t* xq, int64_t K, const float* xs, const float* xsum, const __m512 (*gs)[kVecs],
    const __m512 (*gm)[kVecs]) {
  const int64_t G = FixedG > 0 ? FixedG : L.group, sub = Two ? kSuperBlock / FixedG : 1;
  const int64_t groups = L.groups, vb = kPanel * G * Bits / 8;
  const bool sym = L.zero > 0.f;
  const __m512 neg_zero = _mm512_set1_ps(-L.zero);
  const int64_t head = Two ? quant_head_bytes(sym, sub) : 0;
  for (int64_t j = 0; j < sub; ++j) {
    const int64_t g = b * sub + j;
    const uint8_t* w = block + head + j * vb;
    __m512i dot[R][kVecs];
    group_dots<R, Bits, FixedG>(w, xq + g * G, K, G, dot);
    __m512 s[kVecs], m[kVecs];
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
      if (Two) {
        s[v] = gs[j][v];
        if (!sym) m[v] = gm[j][v];
      } else {  // one level: the group's fp16 scales and mins after its values
        const __m256i* h = reinterpret_cast<const __m256i*>(w + vb);
        s[v] = _mm512_cvtph_ps(_mm256_loadu_si256(h + v));
        if (!sym) m[v] = _mm512_cvtph_ps(_mm256_loadu_si256(h + kVecs + v));
      }
    }
    ASERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(xs[r * groups + g]);
      const __m512 bsum = _mm512_set1_ps(xsum[r * groups + g]);
      if (sym) {  // scale * (xs dot - zero xsum): three operations an output vector, not four
        const __m512 shift = _mm512_mul_ps(neg_zero, bsum);
        ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
          const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][v]), a, shift);
          acc[r][v] = _mm512_fmadd_ps(t, s[v], acc[r][v]);
        }
        continue;
      }
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][v]), a);
        acc[r][v] = _mm512_fmadd_ps(m[v], bsum, _mm512_fmadd_ps(t, s[v], acc[r][v]));
      }
    }
  }
}

// c[0:R, 0:cols] = rows [0, R) of x (quantized: xq with stride K, xs / xsum with stride
// `L.groups`) @ one packed panel, stored by epilogue E. FixedG: the group size, so the k-loops
// unroll whole (0: any, L.group); Two: the layout's two levels (FixedG 16 or 32).
template <int R, int Bits, int E, int FixedG, bool Two>
static void qtile(const int8_t* xq, int64_t K, const float* xs, const float* xsum,
                  const uint8_t* panel, const QuantLayout& L, void* c, int64_t ldc,
                  int64_t cols, const TileEpilogue& ep) {
  __m512 acc[R][kVecs];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  constexpr int64_t kSubs = Two ? kSuperBlock / FixedG : 1;
  __m512 gs[kSubs][kVecs], gm[kSubs][kVecs];
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* block = panel + b * L.block_bytes;
    if constexpr (Two) block_scales<FixedG>(block, L, gs, gm);
    block_sums<R, Bits, FixedG, Two>(acc, block, b, L, xq, K, xs, xsum, gs, gm);
  }
  store_tile<R, E>(acc, c, ldc, cols, ep);
}

// Two levels, more rows than a tile's (a batch's decode): blocks outside, the 4-row tiles
// inside, so that a block's float scales are made once for all its rows rather than once a
// tile; the tiles' sums wait in a buffer on the stack between blocks. rows <= kRowBlock.
template <int R, int Bits, int FixedG>
static inline void block_rows(__m512 (*sums)[kVecs], const uint8_t* block, int64_t b,
                              const QuantLayout& L, const int8_t* xq, int64_t K,
                              const float* xs, const float* xsum, const __m512 (*gs)[kVecs],
                              const __m512 (*gm)[kVecs]) {
  __m512 acc[R][kVecs];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) acc[r][v] = sums[r][v];
  block_sums<R, Bits, FixedG, true>(acc, block, b, L, xq, K, xs, xsum, gs, gm);
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) sums[r][v] = acc[r][v];
}

template <int R, int E>
static inline void store_rows(__m512 (*sums)[kVecs], void* c, int64_t ldc, int64_t cols,
                              const TileEpilogue& ep) {
  __m512 acc[R][kVecs];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) acc[r][v] = sums[r][v];
  store_tile<R, E>(acc, c, ldc, cols, ep);
}

template <int Bits, int E, int FixedG>
static void qrows_two(const int8_t* xq, int64_t K, const float* xs, const float* xsum,
                      const uint8_t* panel, const QuantLayout& L, char* c, int64_t ldc,
                      int64_t item, int64_t rows, int64_t cols, const TileEpilogue& ep) {
  alignas(64) __m512 sums[kRowBlock][kVecs];
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < kVecs; ++v) sums[r][v] = _mm512_setzero_ps();
  __m512 gs[kSuperBlock / FixedG][kVecs], gm[kSuperBlock / FixedG][kVecs];
  const int64_t groups = L.groups;
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* block = panel + b * L.block_bytes;
    block_scales<FixedG>(block, L, gs, gm);
    for (int64_t m = 0; m < rows; m += kQRows) {
      const int8_t* x = xq + m * K;
      const float *a = xs + m * groups, *s = xsum + m * groups;
      switch (std::min(kQRows, rows - m)) {
        case 4: block_rows<4, Bits, FixedG>(sums + m, block, b, L, x, K, a, s, gs, gm); break;
        case 3: block_rows<3, Bits, FixedG>(sums + m, block, b, L, x, K, a, s, gs, gm); break;
        case 2: block_rows<2, Bits, FixedG>(sums + m, block, b, L, x, K, a, s, gs, gm); break;
        default: block_rows<1, Bits, FixedG>(sums + m, block, b, L, x, K, a, s, gs, gm);
      }
    }
  }
  for (int64_t m = 0; m < rows; m += kQRows) {
    void* out = c + m * ldc * item;
    switch (std::min(kQRows, rows - m)) {
      case 4: store_rows<4, E>(sums + m, out, ldc, cols, ep); break;
      case 3: store_rows<3, E>(sums + m, out, ldc, cols, ep); break;
      case 2: store_rows<2, E>(sums + m, out, ldc, cols, ep); break;
      default: store_rows<1, E>(sums + m, out, ldc, cols, ep);
    }
  }
}

using QRows = void (*)(const int8_t*, int64_t, const float*, const float*, const uint8_t*,
                       const QuantLayout&, char*, int64_t, int64_t, int64_t, int64_t,
                       const TileEpilogue&);
#define ASERVE_QROWS(B, G)                                                              \
  {qrows_two<B, kPlain, G>, qrows_two<B, kGatedSplit, G>, qrows_two<B, kGatedSilu, G>, \
   qrows_two<B, kPlainFloat, G>}
// [two levels of 16, of 32][bits: 4, 5, 6, 8][epilogue: gemm.h's first four]
static const QRows kQRowsTwo[2][4][4] = {
    {ASERVE_QROWS(4, 16), {nullptr}, ASERVE_QROWS(6, 16), ASERVE_QROWS(8, 16)},
    {ASERVE_QROWS(4, 32), ASERVE_QROWS(5, 32), ASERVE_QROWS(6, 32), ASERVE_QROWS(8, 32)}};
#undef ASERVE_QROWS

using QTile = void (*)(const int8_t*, int64_t, const float*, const float*, const uint8_t*,
                       const QuantLayout&, void*, int64_t, int64_t, const TileEpilogue&);
#define ASERVE_QTILES(B, E, G, T)                                                  \
  {nullptr, qtile<1, B, E, G, T>, qtile<2, B, E, G, T>, qtile<3, B, E, G, T>,      \
   qtile<4, B, E, G, T>}
#define ASERVE_QTILES_G(B, G, T)                                                   \
  {ASERVE_QTILES(B, kPlain, G, T), ASERVE_QTILES(B, kGatedSplit, G, T),            \
   ASERVE_QTILES(B, kGatedSilu, G, T), ASERVE_QTILES(B, kPlainFloat, G, T)}
#define ASERVE_NO_QTILES {{nullptr}, {nullptr}, {nullptr}, {nullptr}}
#define ASERVE_QTILES_B(G, T, FIVE)                                                \
  {ASERVE_QTILES_G(4, G, T), FIVE, ASERVE_QTILES_G(6, G, T), ASERVE_QTILES_G(8, G, T)}
// [layout: one level of any group, of 16, of 32; two levels of 16, of 32][bits: 4, 5, 6, 8]
// [epilogue: gemm.h's first four][rows]: the groups of GGUF's types have their loops unrolled;
// GPTQ / AWQ's larger ones run the general tiles; 5 bits come in groups of 32 alone
static const QTile kQTiles[5][4][4][kQRows + 1] = {
    ASERVE_QTILES_B(0, false, ASERVE_NO_QTILES), ASERVE_QTILES_B(16, false, ASERVE_NO_QTILES),
    ASERVE_QTILES_B(32, false, ASERVE_QTILES_G(5, 32, false)),
    ASERVE_QTILES_B(16, true, ASERVE_NO_QTILES),
    ASERVE_QTILES_B(32, true, ASERVE_QTILES_G(5, 32, true))};
#undef ASERVE_NO_QTILES
#undef ASERVE_QTILES_B
#undef ASERVE_QTILES_G
#undef ASERVE_QTILES

// The tiles (by rows, 1..kQRows) of a layout and an epilogue.
static inline const QTile* qtiles(const QuantLayout& L, int epilogue) {
  const int fixed = L.group == 16 ? 1 : L.group == 32 ? 2 : 0;
  return kQTiles[L.sub > 1 ? 2 + fixed : fixed][L.bits == 8 ? 3 : L.bits - 4][epilogue];
}


// Many rows: the 5- and 6-bit tiles unpack their values once a tile of 4 rows, so a panel of
// a prompt's rows is unpacked once to bytes (the 8-bit layout, the same scales) in a buffer of
// the thread's, and the 8-bit tiles run over that (4 bits unpack in one AND a vector: their
// tiles keep them). At 512 rows of Llama-3.2-1B's shapes, 6 bits took 0.74 of bf16's time so
// against 0.87 unpacked a tile at a time (5 bits 0.77 against 0.92); at 32 rows (a batch's
// decode) writing and rereading the bytes cost what it saved, so fewer rows keep the tiles
// (docs/benchmarks/quantization.md). A thread keeps the panel it unpacked last (within one
// call: its next task is often the panel's next row block).
constexpr int64_t kUnpackRows = 32;  // more rows than this in a task: unpacked once

// The 8-bit layout of L's values, its scales as L's.
static inline QuantLayout bytes_layout(const QuantLayout& L) {
  const bool sym = L.zero > 0.f;
  QuantLayout B = L;
  B.bits = 8, B.value_bytes = kPanel * L.group;
  B.block_bytes = quant_block_bytes(L.group, 8, sym, L.sub);
  return B;
}

// One group's values (4, 5 or 6 bits, G inputs) at src as bytes at dst (8-bit layout), both
// read and written front to back.
static void unpack_group(const uint8_t* src, int64_t bits, int64_t G, uint8_t* dst) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* top = src + kPanel * G / 2;
  auto nibbles = [&](int64_t k8, int v) {
    return _mm512_loadu_si512(src + (k8 * kVecs + v) * 64);
  };
  auto store = [&](int64_t kq, int v, __m512i q) {
    _mm512_storeu_si512(dst + (kq * kVecs + v) * 64, q);
  };
  if (bits == 4) {
    for (int64_t k8 = 0; k8 < G / 8; ++k8) {
      __m512i n[kVecs];
      for (int v = 0; v < kVecs; ++v) n[v] = nibbles(k8, v);
      for (int v = 0; v < kVecs; ++v) store(2 * k8, v, _mm512_and_si512(n[v], low4));
      for (int v = 0; v < kVecs; ++v)
        store(2 * k8 + 1, v, _mm512_and_si512(_mm512_srli_epi16(n[v], 4), low4));
    }
    return;
  }
  if (bits == 6) {
    for (int64_t k16 = 0; k16 < G / 16; ++k16)
      for (int v = 0; v < kVecs; ++v) {
        __m512i q[4];
        six_bit_quads(nibbles(2 * k16, v), nibbles(2 * k16 + 1, v),
                      _mm512_loadu_si512(top + (k16 * kVecs + v) * 64), q);
        for (int sub = 0; sub < 4; ++sub) store(4 * k16 + sub, v, q[sub]);
      }
    return;
  }
  for (int64_t k32 = 0; k32 < G / 32; ++k32)  // (5 bits)
    for (int64_t i = 0; i < 4; ++i)
      for (int v = 0; v < kVecs; ++v) {
        const __m512i t = _mm512_loadu_si512(top + (k32 * kVecs + v) * 64);
        const __m512i n = nibbles(4 * k32 + i, v);
        for (int s = 2 * static_cast<int>(i); s < 2 * i + 2; ++s)
          store(8 * k32 + s, v, five_bit_quad(n, t, s));
      }
}

// A panel of layout L as bytes (layout B = bytes_layout(L)) in this thread's buffer; `call`
// tells calls apart, so a buffer is reused only within the call that filled it.
static const uint8_t* unpacked_panel(const QuantLayout& L, const QuantLayout& B,
                                     const uint8_t* panel, uint64_t call) {
  static thread_local std::vector<uint8_t> buffer;
  static thread_local const uint8_t* last = nullptr;
  static thread_local uint64_t last_call = 0;
  const int64_t bytes = B.blocks * B.block_bytes;
  if (static_cast<int64_t>(buffer.size()) < bytes + 64) {
    buffer.resize(bytes + 64);
    last = nullptr;
  }
  uint8_t* out = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                                            ~uintptr_t{63});
  if (last == panel && last_call == call) return out;
  const bool sym = L.zero > 0.f;
  const int64_t head = L.sub > 1 ? quant_head_bytes(sym, L.sub) : 0;
  const int64_t tables = L.sub > 1 ? 0 : kQuantScales * (sym ? 1 : 2);  // one level's, a group
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* src = panel + b * L.block_bytes;
    uint8_t* dst = out + b * B.block_bytes;
    std::copy_n(src, head, dst);
    for (int64_t j = 0; j < L.sub; ++j) {
      const uint8_t* values = src + head + j * L.value_bytes;
      uint8_t* into = dst + head + j * B.value_bytes;
      unpack_group(values, L.bits, L.group, into);
      std::copy_n(values + L.value_bytes, tables, into + B.value_bytes);
    }
  }
  last = panel, last_call = call;
  return out;
}

// A task's rows [0, rows) (x quantized: xq, xs / xsum at their row 0) @ one panel into c (row
// stride ldc elements of `item` bytes), by L's tiles, or, past kUnpackRows rows of fewer bits,
// by the 8-bit tiles over the panel unpacked once.
static void qpanel_rows(const QuantLayout& L, int epilogue, const uint8_t* panel, uint64_t call,
                        const int8_t* xq, int64_t K, const float* xs, const float* xsum,
                        int64_t rows, char* c, int64_t ldc, int64_t item, int64_t cols,
                        const TileEpilogue& ep) {
  const QuantLayout* layout = &L;
  QuantLayout B;
  if ((L.bits == 5 || L.bits == 6) && rows > kUnpackRows) {
    B = bytes_layout(L);
    panel = unpacked_panel(L, B, panel, call), layout = &B;
  }
  const QuantLayout& S = *layout;
  if (S.sub > 1 && rows > kQRows && rows <= kRowBlock) {  // two levels, many rows
    const int bits = S.bits == 8 ? 3 : static_cast<int>(S.bits) - 4;
    kQRowsTwo[S.group == 32][bits][epilogue](xq, K, xs, xsum, panel, S, c, ldc, item, rows,
                                             cols, ep);
    return;
  }
  const QTile* tiles = qtiles(*layout, epilogue);
  for (int64_t m = 0; m < rows; m += kQRows)
    tiles[std::min(kQRows, rows - m)](xq + m * K, K, xs + m * L.groups, xsum + m * L.groups,
                                      panel, *layout, c + m * ldc * item, ldc, cols, ep);
}

// A number for each GEMM call (qpanel_rows' `call`).
static inline uint64_t next_qgemm_call() {
  static std::atomic<uint64_t> calls{0};
  return ++calls;
}
#endif

// AVX2 hosts: the same layouts by 8-wide tiles (defines ASERVE_QGEMM_AVX2 where they build).
#include "qgemm_avx2.h"

// Which tiles run qgemm_linear here: "avx512" (AVX512-VNNI and -BF16), "avx2", or "" (none:
// quantized weights are dequantized at load).
std::string qgemm_isa() {
#if defined(ASERVE_QGEMM)
  return "avx512";
#elif defined(ASERVE_QGEMM_AVX2)
  return "avx2";
#else
  return "";
#endif
}

// gemm_linear's contract for a packed quantized weight: y = x [M, K] @ W^T, epilogue 0 (plain,
// + bias), 3 (float32 of the bf16 values), or for a gated pack 1 ([gate | up]) or 2 (SiLU).
torch::Tensor qgemm_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                           c10::optional<torch::Tensor> bias, int64_t epilogue) {
  TORCH_CHECK(!qgemm_isa().empty(), "cpu_qgemm.linear: built without AVX512-VNNI or AVX2");
  const LinearCall call = linear_call("cpu_qgemm.linear", x, packed.size(0), N, bias,
                                      epilogue);
  const int64_t M = call.M, K = call.K, ldc = call.ldc;
  const QuantLayout L = quant_layout(packed, K);
#ifdef ASERVE_QGEMM
  // the quantized activations in a scratch buffer of the calling thread, reused call to call
  // (three tensors a GEMM cost a decode step more than their quantization did); one past
  // 32 MB (a long prompt's) is given back after the call
  static thread_local std::vector<int64_t> scratch;
  const int64_t floats = 2 * M * L.groups, words = (M * K + 7) / 8 + (floats + 1) / 2;
  if (static_cast<int64_t>(scratch.size()) < words) scratch.resize(words);
  float* scales = reinterpret_cast<float*>(scratch.data());
  float* sums = scales + M * L.groups;
  int8_t* a = reinterpret_cast<int8_t*>(scratch.data() + (floats + 1) / 2);
  quantize_rows(x.data_ptr<at::BFloat16>(), M, K, L.group, a, scales, sums);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  char* c = static_cast<char*>(call.y.data_ptr());
  const int64_t item = call.y.element_size();
  const int64_t panel_bytes = L.blocks * L.block_bytes;
  const uint64_t id = next_qgemm_call();
  for_each_panel_task(
      call, packed.size(0), bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
      [&](int64_t p, int64_t m0, int64_t rows, int64_t cols, const TileEpilogue& ep) {
        qpanel_rows(L, static_cast<int>(epilogue), w + p * panel_bytes, id, a + m0 * K, K,
                    scales + m0 * L.groups, sums + m0 * L.groups, rows,
                    c + (m0 * ldc + p * call.width) * item, ldc, item, cols, ep);
      });
  if (words > (int64_t{1} << 22)) std::vector<int64_t>().swap(scratch);  // a long prompt's
#elif defined(ASERVE_QGEMM_AVX2)
  // as above, with the activations' int32 sums a group too (the 8-bit tiles' sign trick)
  static thread_local std::vector<int64_t> scratch;
  const int64_t floats = 3 * M * L.groups, words = (M * K + 7) / 8 + (floats + 1) / 2;
  if (static_cast<int64_t>(scratch.size()) < words) scratch.resize(words);
  float* scales = reinterpret_cast<float*>(scratch.data());
  float* sums = scales + M * L.groups;
  int32_t* isum = reinterpret_cast<int32_t*>(sums + M * L.groups);
  int8_t* a = reinterpret_cast<int8_t*>(scratch.data() + (floats + 1) / 2);
  quantize_rows_avx2(x.data_ptr<at::BFloat16>(), M, K, L.group, a, scales, sums, isum);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  char* c = static_cast<char*>(call.y.data_ptr());
  const int64_t item = call.y.element_size(), panel_bytes = L.blocks * L.block_bytes;
  for_each_panel_task(
      call, packed.size(0), bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
      [&](int64_t p, int64_t m0, int64_t rows, int64_t cols, const TileEpilogue& ep) {
        const int64_t o = m0 * L.groups;
        qpanel_rows_avx2(L, static_cast<int>(epilogue), w + p * panel_bytes, a + m0 * K, K,
                         scales + o, sums + o, isum + o, rows,
                         c + (m0 * ldc + p * call.width) * item, ldc, item, cols, ep);
      });
  if (words > (int64_t{1} << 22)) std::vector<int64_t>().swap(scratch);
#endif
  return call.y;
}

// A linear over a weight packed by either GEMM: uint8 -> qgemm_linear, bf16 -> gemm_linear.
static inline torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                          int64_t N, c10::optional<torch::Tensor> bias,
                                          int64_t epilogue) {
  if (packed.scalar_type() == at::kByte) return qgemm_linear(x, packed, N, bias, epilogue);
  return gemm_linear(x, packed, N, bias, epilogue);
}
