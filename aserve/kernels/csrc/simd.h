// The AVX-512 helpers every aserve CPU kernel shares.
//
// Where the compiler targets AVX-512 (F + BW + VL + DQ), defines ASERVE_AVX512 and:
//
//   load_bf16(p) / load_bf16(p, mask)    16 bf16 -> __m512 (exact: bf16 is float's top half)
//   store_bf16(p, x) / (p, x, mask)      __m512 -> 16 bf16, round to nearest even (NaN stays NaN)
//   round_bf16(x)                        float -> the float nearest bf16 value (what torch does
//                                        between two bf16 ops)
//   exp16(x)                             e^x within ~2 ulp of float (Cephes' expf polynomial on
//                                        [-ln2/2, ln2/2], scaled by 2^n with scalef)
//   tanh16(x)                            tanh(x) = sign(x) (1 - 2 / (e^(2|x|) + 1)), absolute
//                                        error ~1e-7 (soft-capped scores, GELU's tanh)
//   tail_mask(n) / word_mask(n)          the first min(n, 16) float / min(n, 32) bf16 lanes
//   sum16(v)                             16 vectors -> the vector of their 16 horizontal sums
//
// Where it targets AVX2 + FMA, defines ASERVE_YMM and the 8-wide twins the AVX2 kernels share
// (attention_rows.h's row tasks, gemm_avx2.h's tiles, which also build on AVX-512 hosts without
// AVX512-BF16), and where it does not also target AVX-512, ASERVE_AVX2 (the kernels' choice):
//
//   load8_bf16(p)    8 bf16 -> __m256 (exact)
//   store8_bf16(p, x) / round8_bf16(x)   store_bf16 / round_bf16's rounding, 8 lanes (NaN
//                    stays NaN), bit for bit at::BFloat16(float)'s
//   exp8(x)          exp16's polynomial; 2^n by the exponent field, x clamped to
//                    [-87.3, 88.3] (e^x below that is the least normal float, not 0)
//   sum8(v)          the horizontal sum of one vector
//
// Otherwise the kernels keep their scalar loops, which the compiler may vectorize itself.
#pragma once

#include <torch/extension.h>

#include <cstdint>

// Fully unrolls the loop it precedes: loops over compile-time register tiles then keep their
// arrays in registers (GCC otherwise keeps some in memory, storing them every iteration).
#define ASERVE_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define ASERVE_AVX512 1
#include <immintrin.h>

static inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

static inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 load_bf16(const at::BFloat16* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

#ifdef __AVX512BF16__
// Round-to-nearest-even float -> bf16, one vcvtneps2bf16; NaN -> 0x7FC0 as torch rounds it.
static inline __m256i bf16_words(__m512 x) {
  const __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm256_mask_mov_epi16(r, nan, _mm256_set1_epi16(0x7FC0));
}

// The same bits in the low half of each 32-bit lane.
static inline __m512i bf16_bits(__m512 x) { return _mm512_cvtepu16_epi32(bf16_words(x)); }
#else
// Round-to-nearest-even float -> bf16 bits in the low half of each 32-bit lane.
static inline __m512i bf16_bits(__m512 x) {
  const __m512i i = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

static inline __m256i bf16_words(__m512 x) { return _mm512_cvtepi32_epi16(bf16_bits(x)); }
#endif

static inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
}

static inline void store_bf16(at::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_words(x));
}

static inline void store_bf16(at::BFloat16* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, bf16_words(x));
}

// The first min(n, 32) bf16 lanes of a 512-bit word.
static inline __mmask32 word_mask(int64_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1u);
}

// v[0..15] -> the vector of their 16 horizontal sums (a transpose-and-add tree: 45 instructions
// where 16 separate reductions take ~130).
static inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], z[2];
  for (int k = 0; k < 8; ++k)  // 128-bit lane j: (a, b, a, b) partial sums of v[2k], v[2k+1]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // lane j: partial sums of v[4k .. 4k+3]
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)  // fold lanes pairwise
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 exp16(__m512 x) {
  // Clamp so that x - n*ln2 stays finite (NaN passes: max/min return their second operand).
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split hi + lo
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(f, f), f),
                                 _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

static inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 e = exp16(_mm512_add_ps(ax, ax));  // clamped: e^(2|x|) stays finite
  const __m512 t = _mm512_sub_ps(
      _mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define ASERVE_YMM 1
#include <immintrin.h>

static inline __m256 load8_bf16(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Round-to-nearest-even float -> bf16 bits in the low half of each 32-bit lane (NaN: 0x7FC0).
static inline __m256i bf16_bits8(__m256 x) {
  const __m256i i = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

static inline __m256 round8_bf16(__m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}

static inline void store8_bf16(at::BFloat16* p, __m256 x) {
  const __m256i bits = bf16_bits8(x);  // packed within each 128-bit half, then halves joined
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
}

static inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(f, f), f), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));  // n in [-126, 127]: 2^n is normal
}
#endif

#if !defined(ASERVE_AVX512) && defined(ASERVE_YMM)
#define ASERVE_AVX2 1
#endif
