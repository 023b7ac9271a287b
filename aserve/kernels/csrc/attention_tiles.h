// The register tiles of the CPU attention kernel (attend_rows, attention_rows.h): the pieces one
// (tile, kv head) task runs over its keys, each for Q queries of the task at once.
//
// With AVX512-BF16 (keys in lanes; no horizontal sums):
//   pack_keys               blocks of 16 keys transposed once per task: lane t of vector i holds
//                           key t's bf16 pair i (dims 2i, 2i + 1); fetches the next pack's K/V
//   qk_block<NQ, B>         scores of NQ queries for B blocks: one `vdpbf16ps` chain per query
//                           and block over head_dim's pairs, each query's pair broadcast
//   softmax_rows_bf16       float32 softmax of each query over its own keys (and its head's
//                           attention sink), written as bf16 probabilities
//   weighted_pairs<Q, WP>   sum_t p[q, t] v_t for WP words of head_dim on pairs of keys: the bf16
//                           probabilities (p_t, p_t+1) against (v_t, v_t+1) interleaved
// Without it (float32 queries, FMAs):
//   qk_scores_f32           scores 16 keys at a time, then a transpose-reduce (`sum16`)
//   softmax_rows            float32 softmax in place
//   weighted_values<Q, WP>  the weighted sum with a word split into even and odd dims
//
// The tiles are templates on the query count and on head_dim's words (or key blocks), so their
// loops unroll (ASERVE_UNROLL) and every sum stays in a register; kScoreBlock / kWeightedPairs /
// kWeighted pick the instantiation at run time. Everything here is bit-for-bit what a row gets
// whatever tile, block or chunk it lands in: each sum runs in the same order for any query
// count, and key pairs count from an even key. One layer of smol (9 / 3 heads of 64), one
// thread: 512 rows over 1,536 keys 12.1 -> 7.8 ms, 2,048 over 8,192 keys 610 -> 242 ms, against
// the per-key dot products and transpose-reduce before (benchmarks/attention.py --chunks).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

#ifdef ASERVE_AVX512
// Keys whose K and V rows are fetched ahead (blocks scatter): with dpbf16, a pack of keys on
// (pack_keys fetches the next pack's rows while it loads its own; see kKeyBlocks).
#ifdef __AVX512BF16__
constexpr int64_t kAhead = 64;
#else
constexpr int64_t kAhead = 32;
#endif
constexpr int64_t kQueryTile = 8;  // most queries a weighted-values pass keeps in registers

// Fetch `values` bf16 from p on (into L2: the L1's few miss buffers would stall the stream).
static inline void fetch_row(const at::BFloat16* p, int64_t values) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t l = 0; l < 2 * values; l += 64) _mm_prefetch(c + l, _MM_HINT_T1);
}

// Words of head_dim one weighted-values pass takes for q queries (2 q wp sums + 2 wp values
// + 1 probability within the 32 registers).
constexpr int pass_words(int64_t q) { return std::max(1, std::min(4, static_cast<int>(10 / q))); }


static inline void store_scores(float* s, __m512 sc, float scale, float soft_cap,
                                int64_t cnt) {
  sc = _mm512_mul_ps(sc, _mm512_set1_ps(scale));
  if (soft_cap > 0.f) {  // cap * tanh(s / cap), 16 lanes at once
    sc = _mm512_mul_ps(_mm512_set1_ps(soft_cap),
                       tanh16(_mm512_div_ps(sc, _mm512_set1_ps(soft_cap))));
  }
  _mm512_mask_storeu_ps(s, tail_mask(cnt), sc);
}

// The largest of row s's scores over keys [a, e) and, given, its head's sink logit: what a
// softmax subtracts before its exponentials.
static inline float softmax_top(const float* s, int64_t a, int64_t e, const float* sink) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = a; t < e; t += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(e - t), s + t));
  const float top = _mm512_reduce_max_ps(mx);
  return sink ? std::max(top, *sink) : top;
}

#ifdef __AVX512BF16__
// ---- keys in lanes: scores without a horizontal reduction, values on pairs of keys ----
//
// qk_block<NQ>: a block of 16 keys is transposed once (pack_keys: key t's bf16 pair i, dims
// 2i and 2i + 1, into lane t of vector i), then every query's scores for the block are one
// vector: a dpbf16 chain over the pairs with the query's pair i broadcast. weighted_pairs<Q, WP>
// runs the weighted sum of values as dpbf16 on pairs of keys: bf16 probabilities (p_t, p_t+1)
// broadcast against (v_t, v_t+1) interleaved dim by dim, two products per lane and
// instruction. A query's sums run in the same order whatever tile, block or chunk it lands in
// (key pairs count from an even key), so rows stay bit-for-bit batch-invariant.

// In place: the 16 x 16 int32 matrix r (row k = r[k]) becomes its transpose.
static inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  // r[4k + c]: 128-bit lane L holds rows 4L'.. of column block; fold lanes across vectors
  for (int k = 0; k < 2; ++k)
    for (int c = 0; c < 4; ++c) {
      t[8 * k + c] = _mm512_shuffle_i32x4(r[8 * k + c], r[8 * k + 4 + c], 0x88);
      t[8 * k + 4 + c] = _mm512_shuffle_i32x4(r[8 * k + c], r[8 * k + 4 + c], 0xDD);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
  }
}

// kt[16 words b + 16 w + i] = pair i of word w of key 16 b + t in lane t, for the cnt keys
// offs[0..cnt) (lanes past cnt 0), cnt <= 16 kKeyBlocks. The K and V rows kAhead keys on (the
// next pack's) are fetched for the first `ahead` keys, block by block.
static inline void pack_keys(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* offs,
                             int64_t cnt, int64_t ahead, int64_t words, const __mmask32* masks,
                             int64_t d, __m512i* kt) {
  for (int64_t b = 0; 16 * b < cnt; ++b) {
    for (int64_t t = 16 * b; t < std::min(16 * b + 16, ahead); ++t) {
      fetch_row(kc + offs[t + kAhead], d);
      fetch_row(vc + offs[t + kAhead], d);
    }
    for (int64_t w = 0; w < words; ++w) {
      __m512i r[16];
      for (int64_t t = 0; t < 16; ++t)
        r[t] = 16 * b + t < cnt ? _mm512_maskz_loadu_epi16(masks[w], kc + offs[16 * b + t] + 32 * w)
                                : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + 16 * (words * b + w) + i, r[i]);
    }
  }
}

// Scores of NQ queries for B blocks of 16 keys packed by pack_keys (kt + 16 words b: block b;
// `keys` of them in all): query j's pairs are qp[i * NQ + j] (pairs of head_dim), its scores
// go to scores[j * stride] on, and stores none for a block at or past its keys (hi[j] <= t0 +
// 16 b). B blocks at once give NQ * B independent dpbf16 chains: a few queries (a decode row's
// heads) would otherwise wait on each sum's latency.
template <int NQ, int B>
static void qk_block(const __m512i* kt, int64_t pairs, int64_t words, const int32_t* qp,
                     float scale, float soft_cap, float* scores, int64_t stride, int64_t keys,
                     const int64_t* hi, int64_t t0) {
  __m512 acc[NQ][B];
  ASERVE_UNROLL for (int j = 0; j < NQ; ++j)
    ASERVE_UNROLL for (int b = 0; b < B; ++b) acc[j][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i, qp += NQ) {
    __m512bh k[B];
    ASERVE_UNROLL for (int b = 0; b < B; ++b)
      k[b] = (__m512bh)_mm512_load_si512(kt + 16 * words * b + i);
    ASERVE_UNROLL for (int j = 0; j < NQ; ++j) {
      const __m512bh qj = (__m512bh)_mm512_set1_epi32(qp[j]);
      ASERVE_UNROLL for (int b = 0; b < B; ++b) acc[j][b] = _mm512_dpbf16_ps(acc[j][b], qj, k[b]);
    }
  }
  ASERVE_UNROLL for (int j = 0; j < NQ; ++j)
    ASERVE_UNROLL for (int b = 0; b < B; ++b)
      if (t0 + 16 * b < hi[j])
        store_scores(scores + j * stride + 16 * b, acc[j][b], scale, soft_cap, keys - 16 * b);
}

constexpr int kScoreQueries = 12;  // most queries of one qk_block
constexpr int kKeyBlocks = 8;      // blocks of 16 keys packed at once
// Blocks one qk_block takes for nq queries: about 12 sums in registers, or all 8 blocks.
constexpr int score_blocks(int64_t nq) {
  return std::max(1, std::min(kKeyBlocks, static_cast<int>(12 / nq)));
}
using ScoreBlock = void (*)(const __m512i*, int64_t, int64_t, const int32_t*, float, float,
                            float*, int64_t, int64_t, const int64_t*, int64_t);
#define ASERVE_QB(NQ, B) qk_block<NQ, std::min(B, score_blocks(NQ))>
#define ASERVE_QB_ROW(NQ)                                                                   \
  {nullptr,          ASERVE_QB(NQ, 1), ASERVE_QB(NQ, 2), ASERVE_QB(NQ, 3), ASERVE_QB(NQ, 4), \
   ASERVE_QB(NQ, 5), ASERVE_QB(NQ, 6), ASERVE_QB(NQ, 7), ASERVE_QB(NQ, 8)}
// [queries 1..12][blocks 1..8] (read only where blocks <= score_blocks(queries))
static const ScoreBlock kScoreBlock[kScoreQueries + 1][kKeyBlocks + 1] = {
    {},
    ASERVE_QB_ROW(1), ASERVE_QB_ROW(2),  ASERVE_QB_ROW(3),  ASERVE_QB_ROW(4),
    ASERVE_QB_ROW(5), ASERVE_QB_ROW(6),  ASERVE_QB_ROW(7),  ASERVE_QB_ROW(8),
    ASERVE_QB_ROW(9), ASERVE_QB_ROW(10), ASERVE_QB_ROW(11), ASERVE_QB_ROW(12)};
#undef ASERVE_QB_ROW
#undef ASERVE_QB

// In place over scores [nq, n]: query j's softmax over its keys [lo[j], hi[j]) (float32), as
// bf16 probabilities probs[j * p_stride + t] (0 elsewhere, up to p_stride), unnormalized; inv[j]
// = 1 / the sum of those bf16 probabilities (so the weights the values get sum to one). Sinks as
// in softmax_rows.
static void softmax_rows_bf16(float* scores, int64_t n, int64_t nq, const int64_t* lo,
                              const int64_t* hi, const float* sinks, int64_t group, float* inv,
                              uint16_t* probs, int64_t p_stride) {
  for (int64_t j = 0; j < nq; ++j) {
    const float* sj = scores + j * n;
    uint16_t* pj = probs + j * p_stride;
    const int64_t a = lo[j], e = hi[j];
    std::fill(pj, pj + a, uint16_t{0});
    std::fill(pj + e, pj + p_stride, uint16_t{0});
    const float top = softmax_top(sj, a, e, sinks ? sinks + j % group : nullptr);
    const __m512 m = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = a; t < e; t += 16) {
      const __mmask16 tm = tail_mask(e - t);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tm, sj + t), m);
      const __m256i words = bf16_words(_mm512_maskz_mov_ps(tm, exp16(x)));
      _mm256_mask_storeu_epi16(pj + t, tm, words);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(
                                   _mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16)));
    }
    float total = _mm512_reduce_add_ps(sum);
    if (sinks) total += std::exp(sinks[j % group] - top);
    inv[j] = 1.f / total;
  }
}

// o[g][32 w : 32 (w + 1)] for the words w0 <= w < w0 + WP of head_dim = inv[g] * sum_t p[g, t]
// v_t over the keys t0 <= t < nk (t0 even; offs[nk] readable, its probability 0 where nk is
// odd), two keys a step: a lane of lo / hi sums dim 8L + e / 8L + 4 + e (L its 128-bit lane, e
// its place in it; unpacklo / unpackhi's order), put back in order when stored.
template <int Q, int WP>
static void weighted_pairs(const at::BFloat16* vc, const int64_t* offs, int64_t t0, int64_t nk,
                           const uint16_t* p, int64_t p_stride, int64_t w0,
                           const __mmask32* masks, const float* inv, at::BFloat16* const* o) {
  __m512 lo[Q][WP], hi[Q][WP];
  ASERVE_UNROLL for (int g = 0; g < Q; ++g)
    ASERVE_UNROLL for (int w = 0; w < WP; ++w) lo[g][w] = hi[g][w] = _mm512_setzero_ps();
  for (int64_t t = t0; t < nk; t += 2) {
    const at::BFloat16* v0 = vc + offs[t] + 32 * w0;
    const at::BFloat16* v1 = vc + offs[t + 1] + 32 * w0;
    __m512i vl[WP], vh[WP];
    ASERVE_UNROLL for (int w = 0; w < WP; ++w) {
      const __m512i x0 = _mm512_maskz_loadu_epi16(masks[w0 + w], v0 + 32 * w);
      const __m512i x1 = _mm512_maskz_loadu_epi16(masks[w0 + w], v1 + 32 * w);
      vl[w] = _mm512_unpacklo_epi16(x0, x1);
      vh[w] = _mm512_unpackhi_epi16(x0, x1);
    }
    ASERVE_UNROLL for (int g = 0; g < Q; ++g) {
      int32_t pair;
      std::memcpy(&pair, p + g * p_stride + t, sizeof(pair));
      const __m512bh pg = (__m512bh)_mm512_set1_epi32(pair);
      ASERVE_UNROLL for (int w = 0; w < WP; ++w) {
        lo[g][w] = _mm512_dpbf16_ps(lo[g][w], pg, (__m512bh)vl[w]);
        hi[g][w] = _mm512_dpbf16_ps(hi[g][w], pg, (__m512bh)vh[w]);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  ASERVE_UNROLL for (int g = 0; g < Q; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    ASERVE_UNROLL for (int w = 0; w < WP; ++w) {
      const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][w], first, hi[g][w]), s);
      const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][w], second, hi[g][w]), s);
      const __m512i words =
          _mm512_inserti64x4(_mm512_castsi256_si512(bf16_words(a)), bf16_words(b), 1);
      _mm512_mask_storeu_epi16(o[g] + 32 * (w0 + w), masks[w0 + w], words);
    }
  }
}

#define ASERVE_PAIRS_ROW(Q)                                                              \
  {nullptr, weighted_pairs<Q, std::min(1, pass_words(Q))>,                               \
   weighted_pairs<Q, std::min(2, pass_words(Q))>,                                        \
   weighted_pairs<Q, std::min(3, pass_words(Q))>,                                        \
   weighted_pairs<Q, std::min(4, pass_words(Q))>}
using WeightedPairs = void (*)(const at::BFloat16*, const int64_t*, int64_t, int64_t,
                               const uint16_t*, int64_t, int64_t, const __mmask32*, const float*,
                               at::BFloat16* const*);
// [queries 1..8][words 1..4]
static const WeightedPairs kWeightedPairs[9][5] = {
    {}, ASERVE_PAIRS_ROW(1), ASERVE_PAIRS_ROW(2), ASERVE_PAIRS_ROW(3), ASERVE_PAIRS_ROW(4),
    ASERVE_PAIRS_ROW(5), ASERVE_PAIRS_ROW(6), ASERVE_PAIRS_ROW(7), ASERVE_PAIRS_ROW(8)};
#undef ASERVE_PAIRS_ROW
#endif  // __AVX512BF16__

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
    const float top = softmax_top(sj, a, e, sinks ? sinks + j % group : nullptr);
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
#endif

#endif  // ASERVE_AVX512
