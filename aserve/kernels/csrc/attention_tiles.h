// The register tiles of the CPU attention kernel (attend_rows, attention_rows.h): the pieces one
// (tile, kv head) task runs over its keys, each for Q queries of the task at once.
//
//   qk_scores<NQ, W>        scores of NQ queries against keys 16 at a time: each key's W words
//                           (32 bf16 of head_dim) into a `vdpbf16ps` chain per query, then a
//                           transpose-reduce (`sum16`); fetches the K and V rows kAhead keys on
//   qk_scores_f32           the same without AVX512-BF16 (float32 queries, FMAs)
//   softmax_rows            float32 softmax of each query over its own keys (and its head's
//                           attention sink, where there are sinks)
//   weighted_values<Q, WP>  sum_t p[q, t] v_t for WP words of head_dim, all sums in registers (a
//                           bf16 word splits into even and odd dims with a shift and a mask)
//
// The tiles are templates on the query count and on head_dim's words, so their loops unroll
// (ASERVE_UNROLL) and every sum stays in a register; kScores / kWeighted pick the instantiation
// at run time. Everything here is bit-for-bit what a row gets whatever tile it lands in: the sums
// run in the same order for any query count.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

#ifdef ASERVE_AVX512
constexpr int64_t kAhead = 32;  // keys whose K and V rows are fetched ahead (blocks scatter)
constexpr int64_t kQueryTile = 8;  // most queries a weighted-values pass keeps in registers

// Fetch `values` bf16 from p on (into L2: the L1's few miss buffers would stall the stream).
static inline void fetch_row(const at::BFloat16* p, int64_t values) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t l = 0; l < 2 * values; l += 64) _mm_prefetch(c + l, _MM_HINT_T1);
}

// o[g][32 w : 32 (w + 1)] for the words w0 <= w < w0 + WP of head_dim = inv[g] * sum_t p[g, t] *
// v_t, for Q queries, all 2 Q WP sums in registers. A word of 32 bf16 splits into its even and
// odd dims as two float vectors with one shift and one mask (bf16 is float's top half); the two
// halves are put back together as bf16 pairs when stored.
template <int Q, int WP>
static void weighted_values(const at::BFloat16* vc, const int64_t* offs, int64_t n,
                            const float* p, int64_t p_stride, int64_t w0, const __mmask32* masks,
                            const float* inv, at::BFloat16* const* o) {
  __m512 even[Q][WP], odd[Q][WP];
  ASERVE_UNROLL for (int g = 0; g < Q; ++g)
    ASERVE_UNROLL for (int w = 0; w < WP; ++w) even[g][w] = odd[g][w] = _mm512_setzero_ps();
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t t = 0; t < n; ++t) {
    const at::BFloat16* v = vc + offs[t] + 32 * w0;
    __m512 ve[WP], vo[WP];
    ASERVE_UNROLL for (int w = 0; w < WP; ++w) {
      const __m512i x = _mm512_maskz_loadu_epi16(masks[w0 + w], v + 32 * w);
      ve[w] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      vo[w] = _mm512_castsi512_ps(_mm512_and_si512(x, top));
    }
    ASERVE_UNROLL for (int g = 0; g < Q; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
      ASERVE_UNROLL for (int w = 0; w < WP; ++w) {
        even[g][w] = _mm512_fmadd_ps(pg, ve[w], even[g][w]);
        odd[g][w] = _mm512_fmadd_ps(pg, vo[w], odd[g][w]);
      }
    }
  }
  ASERVE_UNROLL for (int g = 0; g < Q; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    ASERVE_UNROLL for (int w = 0; w < WP; ++w) {
      const __m512i lo = bf16_bits(_mm512_mul_ps(even[g][w], s));
      const __m512i hi = bf16_bits(_mm512_mul_ps(odd[g][w], s));
      _mm512_mask_storeu_epi16(o[g] + 32 * (w0 + w), masks[w0 + w],
                               _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Words of head_dim one weighted-values pass takes for q queries (2 q wp sums + 2 wp values
// + 1 probability within the 32 registers).
constexpr int pass_words(int64_t q) { return std::max(1, std::min(4, static_cast<int>(10 / q))); }

using WeightedValues = void (*)(const at::BFloat16*, const int64_t*, int64_t, const float*,
                                int64_t, int64_t, const __mmask32*, const float*,
                                at::BFloat16* const*);
#define ASERVE_PV_ROW(Q)                                                                  \
  {nullptr, weighted_values<Q, std::min(1, pass_words(Q))>,                              \
   weighted_values<Q, std::min(2, pass_words(Q))>,                                       \
   weighted_values<Q, std::min(3, pass_words(Q))>,                                       \
   weighted_values<Q, std::min(4, pass_words(Q))>}
// [queries 1..8][words 1..4]
static const WeightedValues kWeighted[9][5] = {
    {}, ASERVE_PV_ROW(1), ASERVE_PV_ROW(2), ASERVE_PV_ROW(3), ASERVE_PV_ROW(4),
    ASERVE_PV_ROW(5), ASERVE_PV_ROW(6), ASERVE_PV_ROW(7), ASERVE_PV_ROW(8)};
#undef ASERVE_PV_ROW

static inline void store_scores(float* s, __m512 sc, float scale, float soft_cap,
                                int64_t cnt) {
  sc = _mm512_mul_ps(sc, _mm512_set1_ps(scale));
  if (soft_cap > 0.f) {  // cap * tanh(s / cap), 16 lanes at once
    sc = _mm512_mul_ps(_mm512_set1_ps(soft_cap),
                       tanh16(_mm512_div_ps(sc, _mm512_set1_ps(soft_cap))));
  }
  _mm512_mask_storeu_ps(s, tail_mask(cnt), sc);
}

#ifdef __AVX512BF16__
// Queries of one scores pass: their NQ x W bf16 words stay in registers.
constexpr int pass_queries(int64_t words) {
  return std::max(1, std::min(8, static_cast<int>(16 / words)));
}

// scores[j * stride + t] = scale * <q_j, k_t> for keys t < n and NQ queries whose bf16 words
// are qw[j * W + w]: 16 keys at a time, each key's W words into a dpbf16 chain per query (exact
// products, float32 sums), then a transpose-reduce; a query skips the groups past its hi[j].
// With `fetch`, the K and V rows kAhead keys on are fetched as it goes.
template <int NQ, int W>
static void qk_scores(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* offs,
                      int64_t n, const __m512i* qw, const __mmask32* masks, const int64_t* hi,
                      float scale, float soft_cap, float* scores, int64_t stride, int64_t d,
                      bool fetch) {
  __m512i qv[NQ][W];
  for (int j = 0; j < NQ; ++j)
    for (int w = 0; w < W; ++w) qv[j][w] = qw[j * W + w];
  __m512 part[NQ][16];
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - t0);
    for (int64_t i = 0; i < cnt; ++i) {
      const int64_t t = t0 + i;
      if (fetch && t + kAhead < n) {
        fetch_row(kc + offs[t + kAhead], d);
        fetch_row(vc + offs[t + kAhead], d);
      }
      const at::BFloat16* k = kc + offs[t];
      __m512i kw[W];
      for (int w = 0; w < W; ++w) kw[w] = _mm512_maskz_loadu_epi16(masks[w], k + 32 * w);
      for (int j = 0; j < NQ; ++j) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qv[j][0], (__m512bh)kw[0]);
        for (int w = 1; w < W; ++w) a = _mm512_dpbf16_ps(a, (__m512bh)qv[j][w], (__m512bh)kw[w]);
        part[j][i] = a;
      }
    }
    for (int64_t i = cnt; i < 16; ++i)  // lanes past the last key: stored masked, kept defined
      for (int j = 0; j < NQ; ++j) part[j][i] = _mm512_setzero_ps();
    for (int j = 0; j < NQ; ++j)
      if (t0 < hi[j]) store_scores(scores + j * stride + t0, sum16(part[j]), scale, soft_cap, cnt);
  }
}

using Scores = void (*)(const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t,
                        const __m512i*, const __mmask32*, const int64_t*, float, float, float*,
                        int64_t, int64_t, bool);
// entry NQ of row W: NQ queries if they fit a pass (the table is only read where they do)
#define ASERVE_QK(NQ, W) qk_scores<std::min(NQ, pass_queries(W)), W>
#define ASERVE_QK_ROW(W)                                                                   \
  {nullptr,         ASERVE_QK(1, W), ASERVE_QK(2, W), ASERVE_QK(3, W), ASERVE_QK(4, W),    \
   ASERVE_QK(5, W), ASERVE_QK(6, W), ASERVE_QK(7, W), ASERVE_QK(8, W)}
// [words 1..8][queries 1..8]
static const Scores kScores[9][9] = {
    {}, ASERVE_QK_ROW(1), ASERVE_QK_ROW(2), ASERVE_QK_ROW(3), ASERVE_QK_ROW(4),
    ASERVE_QK_ROW(5), ASERVE_QK_ROW(6), ASERVE_QK_ROW(7), ASERVE_QK_ROW(8)};
#undef ASERVE_QK_ROW
#undef ASERVE_QK
#endif

#ifndef __AVX512BF16__
// `qk_scores` without dpbf16: float32 queries qf [nq, d] (pre-scaled) against keys t < n, 16 at
// a time into part sums and a transpose-reduce; the K and V rows kAhead keys on are fetched.
static void qk_scores_f32(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* offs,
                          int64_t n, const float* qf, int64_t nq, int64_t d, const int64_t* hi,
                          float soft_cap, float* scores, int64_t stride) {
  std::vector<__m512> part(nq * 16);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - t0);
    for (int64_t i = 0; i < cnt; ++i) {
      if (t0 + i + kAhead < n) {
        fetch_row(kc + offs[t0 + i + kAhead], d);
        fetch_row(vc + offs[t0 + i + kAhead], d);
      }
      const at::BFloat16* k = kc + offs[t0 + i];
      __m512 kv[16];
      for (int64_t c = 0; c < d / 16; ++c) kv[c] = load_bf16(k + 16 * c);
      for (int64_t j = 0; j < nq; ++j) {
        const float* qj = qf + j * d;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
        for (int64_t c = 1; c < d / 16; ++c)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), kv[c], a);
        part[j * 16 + i] = a;
      }
    }
    for (int64_t j = 0; j < nq; ++j)
      if (t0 < hi[j])
        store_scores(scores + j * stride + t0, sum16(&part[j * 16]), 1.f, soft_cap, cnt);
  }
}
#endif

// In place: row j of scores [nq, n] becomes the softmax of its keys [lo[j], hi[j]) (float32),
// unnormalized, with probability 0 elsewhere; inv[j] = 1 / its sum. With `sinks` (the task's
// G = `group` heads' sink logits; row j is head j % group) the row's sink joins its max and its
// sum but gets no column.
static void softmax_rows(float* scores, int64_t n, int64_t nq, const int64_t* lo,
                         const int64_t* hi, const float* sinks, int64_t group, float* inv) {
  for (int64_t j = 0; j < nq; ++j) {
    float* sj = scores + j * n;
    const int64_t a = lo[j], e = hi[j];
    std::fill(sj, sj + a, 0.f);
    std::fill(sj + e, sj + n, 0.f);
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = a; t < e; t += 16)
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(e - t), sj + t));
    float top = _mm512_reduce_max_ps(mx);
    if (sinks) top = std::max(top, sinks[j % group]);
    const __m512 m = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = a; t < e; t += 16) {
      const __mmask16 tm = tail_mask(e - t);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tm, sj + t), m);
      const __m512 ex = _mm512_maskz_mov_ps(tm, exp16(x));
      _mm512_mask_storeu_ps(sj + t, tm, ex);
      sum = _mm512_add_ps(sum, ex);
    }
    float total = _mm512_reduce_add_ps(sum);
    if (sinks) total += std::exp(sinks[j % group] - top);
    inv[j] = 1.f / total;
  }
}
#endif  // ASERVE_AVX512
