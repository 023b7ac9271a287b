// Attention on CPU for every row of a batch, bf16 + AVX-512, reading K/V straight from the paged
// cache (the C++ of aserve/kernels/cpu_attention.py):
//
//   attend_rows     tiles of up to ROW_TILE query rows of one request (a decode row is a tile of
//                   one; a prefill chunk, with or without cached context, is cut into tiles)
//   store_kv        this step's K/V rows into their slots
//   rows_supported  whether attend_rows runs here for q
//
// One task per (tile, kv head) serves the tile's rows x G = Hq / Hkv query heads at once, so each
// K/V row is read once per task; row j of a tile attends the first len0 + j keys of its sequence:
//
//   block_table[r] = [7, 2, 5]   seq_len = 10, block_size = 4
//   keys t = 0..9 at  k_cache[7][0..3], k_cache[2][0..3], k_cache[5][0..1]   (head h of each)
//   a chunk of 3 rows ending at key 9: rows attend keys 0..7, 0..8, 0..9
//
// With a sliding window W a task reads keys from its first row's first, len0 - W, on (each row
// then masks its own): no block before it is read, as a hybrid cache may have freed it. With
// attention sinks (sinks.h) each query head's sink joins its rows' softmax.
//
// The per-task work (with AVX512-BF16: keys transposed into lanes 128 at a time, every query's
// scores against them, a float32 softmax over each query's own keys into bf16 probabilities, the
// weighted sum of values on pairs of keys, its sums in registers) is the register tiles of
// attention_tiles.h. Blocks are scattered in memory, so the score pass fetches the K and V rows
// kAhead keys ahead into L2, each task the first rows of the next, and threads claim tasks one
// at a time, costliest
// first (cpu_attention.plan_tiles orders them). 64 x 192-key decode rows, one smol layer with the
// cache in DRAM: 0.64 -> 0.46 ms (benchmarks/attention.py).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_tiles.h"
#include "simd.h"
#include "sinks.h"

#ifdef ASERVE_AVX512
// bf16 attention over the paged cache for tiles of query rows, head_dim a multiple of 16 (at
// most 256). Tile i = tiles[i] = (request, first row, rows, keys of its first row): row j of the
// tile attends the first len0 + j keys of its sequence (the causal rule of a prefill chunk; a
// decode row is a tile of one). One task per (tile, kv head) serves the tile's rows x G query
// heads together, so each K/V row is read once per task: scores, softmax and weighted values
// by the register tiles of attention_tiles.h. The first pass over the keys fetches K and V
// rows ahead, and each task the first rows of the next.
static void attend_tiles_bf16(const at::BFloat16* q, const at::BFloat16* kc,
                              const at::BFloat16* vc, const int32_t* table,
                              const int64_t* tiles, int64_t num_tiles, at::BFloat16* out,
                              int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                              int64_t table_stride, int64_t q_stride, float scale,
                              int64_t window, float soft_cap, const float* sinks) {
  const int64_t group = hq / hkv, words = (d + 31) / 32;
  __mmask32 masks[8];
  for (int64_t w = 0; w < words; ++w) masks[w] = word_mask(d - 32 * w);
  // Tasks differ in cost (a prefill tile against a decode row): threads claim them one at a
  // time, in the order given (plan_tiles puts the costly ones first).
  const int64_t num_tasks = num_tiles * hkv;
  std::atomic<int64_t> claimed{0};
  // A task's first key: its first row's window start, made even where blocks hold an even count
  // of keys (the key before stays in the same block), so key pairs count from an even key.
  const auto first_key = [&](int64_t len0) -> int64_t {
    if (window <= 0) return 0;
    const int64_t first = std::max<int64_t>(0, len0 - window);
    return bs % 2 == 0 ? first & ~int64_t{1} : first;
  };
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf, scores, inv;
    std::vector<int64_t> offs, lo, hi;
    std::vector<__m512i> kt;  // a block of keys, packed
    std::vector<int32_t> qp;
    std::vector<uint16_t> probs;
    std::vector<at::BFloat16*> outs;
    // The K and V rows of a task's first kAhead keys, fetched while the task before it runs.
    const auto fetch_first = [&](int64_t task) {
      const int64_t* tile = tiles + 4 * (task / hkv);
      const int64_t h = task % hkv, len0 = tile[3];
      const int64_t first = first_key(len0);
      const int64_t last = std::min(first + kAhead, len0 + tile[2] - 1);
      const int32_t* blocks = table + tile[0] * table_stride;
      for (int64_t t = first; t < last; ++t) {
        const int64_t off = ((static_cast<int64_t>(blocks[t / bs]) * bs + t % bs) * hkv + h) * d;
        fetch_row(kc + off, d);
        fetch_row(vc + off, d);
      }
    };
    int64_t task = claimed.fetch_add(1);
    if (task < num_tasks) fetch_first(task);
    for (int64_t following; task < num_tasks; task = following) {
      following = claimed.fetch_add(1);
      if (following < num_tasks) fetch_first(following);
      const int64_t* tile = tiles + 4 * (task / hkv);
      const int64_t h = task % hkv;
      const int64_t r = tile[0], row0 = tile[1], rows = tile[2], len0 = tile[3];
      const int64_t nq = rows * group;  // query j * group + g: row row0 + j, head h * group + g
      const int64_t first = first_key(len0);
      const int64_t n = len0 + rows - 1 - first;  // keys [first, first + n) cover the tile
      const int32_t* blocks = table + r * table_stride;
      offs.resize(n);
      for (int64_t t = 0, j = first / bs, o = first % bs; t < n; ++j, o = 0)
        for (const int64_t base = static_cast<int64_t>(blocks[j]) * bs; o < bs && t < n; ++o)
          offs[t++] = ((base + o) * hkv + h) * d;
      lo.resize(nq);
      hi.resize(nq);
      outs.resize(nq);
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t len = len0 + j;
        for (int64_t g = 0; g < group; ++g) {
          lo[j * group + g] = (window > 0 ? std::max<int64_t>(0, len - window) : 0) - first;
          hi[j * group + g] = len - first;
          outs[j * group + g] = out + ((row0 + j) * hq + h * group + g) * d;
        }
      }
      scores.resize(nq * n);
      inv.resize(nq);
#ifdef __AVX512BF16__
      // queries' bf16 pairs packed per score block: qp[j0 * pairs + i * nqc + j]
      const int64_t pairs = d / 2;
      qp.resize(nq * pairs);
      for (int64_t j0 = 0; j0 < nq; j0 += kScoreQueries) {
        const int64_t nqc = std::min<int64_t>(kScoreQueries, nq - j0);
        for (int64_t j = 0; j < nqc; ++j) {
          const int64_t jj = j0 + j;
          const at::BFloat16* qj =
              q + (row0 + jj / group) * q_stride + (h * group + jj % group) * d;
          for (int64_t i = 0; i < pairs; ++i)
            std::memcpy(&qp[j0 * pairs + i * nqc + j], qj + 2 * i, sizeof(int32_t));
        }
      }
      kt.resize(16 * words * kKeyBlocks);
      for (int64_t t0 = 0; t0 < n; t0 += 16 * kKeyBlocks) {
        const int64_t cnt = std::min<int64_t>(16 * kKeyBlocks, n - t0);
        const int64_t nb = (cnt + 15) / 16;
        pack_keys(kc, vc, &offs[t0], cnt, n - kAhead - t0, words, masks, d, kt.data());
        for (int64_t j0 = 0; j0 < nq; j0 += kScoreQueries) {
          const int64_t nqc = std::min<int64_t>(kScoreQueries, nq - j0);
          const int64_t bq = score_blocks(nqc), last = hi[j0 + nqc - 1];  // hi grows with j
          for (int64_t b = 0; b < nb && t0 + 16 * b < last; b += bq)
            kScoreBlock[nqc][std::min(bq, nb - b)](
                &kt[16 * words * b], pairs, words, &qp[j0 * pairs], scale, soft_cap,
                &scores[j0 * n + t0 + 16 * b], n, cnt - 16 * b, &hi[j0], t0 + 16 * b);
        }
      }
      // bf16 probabilities over an even count of keys: offs[n] is key n - 1 again (weight 0)
      const int64_t p_stride = n + (n & 1);
      offs.push_back(offs[n - 1]);
      probs.resize(nq * p_stride);
      softmax_rows_bf16(scores.data(), n, nq, lo.data(), hi.data(),
                        sinks ? sinks + h * group : nullptr, group, inv.data(), probs.data(),
                        p_stride);
      for (int64_t j0 = 0; j0 < nq; j0 += kQueryTile) {
        const int64_t nt = std::min(kQueryTile, nq - j0), wp = pass_words(nt);
        // keys outside every query's range carry probability 0 for all: skip them
        const int64_t nk = *std::max_element(hi.begin() + j0, hi.begin() + j0 + nt);
        const int64_t t_lo =
            *std::min_element(lo.begin() + j0, lo.begin() + j0 + nt) & ~int64_t{1};
        for (int64_t w0 = 0; w0 < words; w0 += wp)
          kWeightedPairs[nt][std::min(wp, words - w0)](vc, offs.data(), t_lo, nk,
                                                       &probs[j0 * p_stride], p_stride, w0,
                                                       masks, &inv[j0], &outs[j0]);
      }
#else
      qf.resize(nq * d);  // float32 queries, pre-scaled
      for (int64_t j = 0; j < nq; ++j) {
        const at::BFloat16* qj =
            q + (row0 + j / group) * q_stride + (h * group + j % group) * d;
        for (int64_t i = 0; i < d; i += 16)
          _mm512_storeu_ps(&qf[j * d + i], _mm512_mul_ps(load_bf16(qj + i), _mm512_set1_ps(scale)));
      }
      qk_scores_f32(kc, vc, offs.data(), n, qf.data(), nq, d, hi.data(), soft_cap, scores.data(),
                    n);
      softmax_rows(scores.data(), n, nq, lo.data(), hi.data(),
                   sinks ? sinks + h * group : nullptr, group, inv.data());
      for (int64_t j0 = 0; j0 < nq; j0 += kQueryTile) {
        const int64_t nt = std::min(kQueryTile, nq - j0), wp = pass_words(nt);
        // keys past the last query's range carry probability 0 for all: skip them
        const int64_t nk = *std::max_element(hi.begin() + j0, hi.begin() + j0 + nt);
        for (int64_t w0 = 0; w0 < words; w0 += wp)
          kWeighted[nt][std::min(wp, words - w0)](vc, offs.data(), nk, &scores[j0 * n], n, w0,
                                                  masks, &inv[j0], &outs[j0]);
      }
#endif
    }
  });
}
#endif

#ifdef ASERVE_AVX2
// The same tiles on AVX2 hosts (whose whole-layer call needs them): per (tile, kv heads)
// task, each row in turn, float32 throughout, 8 lanes wide. Scores 8 keys at a time: each
// key's dot product with a query head in one FMA chain over head_dim's vectors (each K vector
// made float once for up to 3 heads of its group: `score_keys`), the 8 chains summed across
// lanes at once (`sum8x8`: key k in lane k; a row's last keys padded with copies of its last
// one, their lanes unused), scaled and soft-capped; each head's softmax runs over the row's
// own keys (and its sink) in vectors of 8 from its first key, exp8; the weighted values 4
// vectors of head_dim at a time (`weigh_values`: two heads' sums in registers), 64 keys for
// every head of the task before the next 64 (their V rows fetched a chunk ahead), one rounding
// to bf16. Every sum of a row runs in the same order whatever tile and task it lands in, so
// rows stay batch-invariant.
constexpr int64_t kAheadAvx2 = 16;  // keys fetched ahead of the score pass

// The horizontal sums of s[0..7] as one vector: lane k holds the sum of s[k]'s lanes, always
// added as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
static inline __m256 sum8x8(const __m256* s) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// sums[g][c] = the lanes of head g's dot product with key c (K rows at k[0..7]) for G query
// heads (qf: their float vectors, nv each), KB keys at a time: each K vector is made float
// once for the G heads (not once a head), so a group's heads share its conversions. Every
// (head, key) pair keeps one FMA chain over head_dim in order, as one head at a time would.
template <int G, int KB>
static inline void score_keys(const __m256* qf, int64_t nv, const at::BFloat16* const* k,
                              __m256 (*sums)[8]) {
  ASERVE_UNROLL for (int k0 = 0; k0 < 8; k0 += KB) {
    __m256 acc[G][KB];
    ASERVE_UNROLL for (int g = 0; g < G; ++g)
      ASERVE_UNROLL for (int c = 0; c < KB; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nv; ++i) {
      __m256 kv[KB];
      ASERVE_UNROLL for (int c = 0; c < KB; ++c) kv[c] = load8_bf16(k[k0 + c] + 8 * i);
      ASERVE_UNROLL for (int g = 0; g < G; ++g) {
        const __m256 x = qf[g * nv + i];
        ASERVE_UNROLL for (int c = 0; c < KB; ++c) acc[g][c] = _mm256_fmadd_ps(x, kv[c], acc[g][c]);
      }
    }
    ASERVE_UNROLL for (int g = 0; g < G; ++g)
      ASERVE_UNROLL for (int c = 0; c < KB; ++c) sums[g][k0 + c] = acc[g][c];
  }
}

// acc_h[8 c0 .. 8 (c0 + C)) += sum_t p_h[t] v_t for heads h of [0, H), over `count` keys
// whose V rows start at vc + offs[t] (p_h: head h's probabilities, `stride` apart; acc_h: its
// float sums at acc + h * d). The sums go through memory between calls, so a row's keys can
// be weighed a chunk at a time (every head's chunk while its V rows are in cache): each sum
// keeps one chain over the row's keys in order, whatever the chunks.
template <int C, int H>
static inline void weigh_values(const float* p, int64_t stride, const at::BFloat16* vc,
                                const int64_t* offs, int64_t count, int64_t c0, float* acc,
                                int64_t d) {
  __m256 o[H][C];
  ASERVE_UNROLL for (int h = 0; h < H; ++h)
    ASERVE_UNROLL for (int i = 0; i < C; ++i) o[h][i] = _mm256_loadu_ps(acc + h * d + 8 * (c0 + i));
  for (int64_t t = 0; t < count; ++t) {
    const at::BFloat16* v = vc + offs[t] + 8 * c0;
    __m256 w[H];
    ASERVE_UNROLL for (int h = 0; h < H; ++h) w[h] = _mm256_broadcast_ss(p + h * stride + t);
    ASERVE_UNROLL for (int i = 0; i < C; ++i) {
      const __m256 x = load8_bf16(v + 8 * i);
      ASERVE_UNROLL for (int h = 0; h < H; ++h) o[h][i] = _mm256_fmadd_ps(w[h], x, o[h][i]);
    }
  }
  ASERVE_UNROLL for (int h = 0; h < H; ++h)
    ASERVE_UNROLL for (int i = 0; i < C; ++i) _mm256_storeu_ps(acc + h * d + 8 * (c0 + i), o[h][i]);
}

constexpr int64_t kChunkAvx2 = 64;  // keys weighed for every head of a task before the next

// Tasks are (tile, range of kv heads): every kv head of a decode row's tile in one task where
// the tiles alone keep the threads busy (each key's K and V rows, all heads side by side in
// the cache, then read once, in order: the head-by-head walk read a third of every line run
// the prefetcher fetched, 1.49 against 0.91 ms a smol layer of 8 rows x 1,100 keys from
// memory), one head a task where they do not (a decode of a few rows) and for a tile of
// several rows (whose rows each walk the keys again: one head's K and V stay in L2, all
// heads' do not). Which, changes no bit: every sum keeps its order.
static void attend_tiles_avx2(const at::BFloat16* q, const at::BFloat16* kc,
                              const at::BFloat16* vc, const int32_t* table,
                              const int64_t* tiles, int64_t num_tiles, at::BFloat16* out,
                              int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                              int64_t table_stride, int64_t q_stride, float scale,
                              int64_t window, float soft_cap, const float* sinks) {
  const int64_t group = hq / hkv, nv = d / 8, threads = at::get_num_threads();
  // Tasks: (tile, first kv head, kv heads). A decode row's tile is one task of every kv head
  // where the tiles alone keep the threads busy; a tile of several rows (a prefill chunk)
  // keeps a task a kv head, whose K and V stay in L2 while each row walks them again.
  const bool whole_rows = num_tiles >= 2 * threads;
  std::vector<int64_t> tasks;  // 3 a task
  tasks.reserve(3 * num_tiles * hkv);
  for (int64_t i = 0; i < num_tiles; ++i) {
    if (whole_rows && tiles[4 * i + 2] == 1) {
      tasks.insert(tasks.end(), {i, 0, hkv});
    } else {
      for (int64_t h = 0; h < hkv; ++h) tasks.insert(tasks.end(), {i, h, 1});
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size()) / 3;
  const int64_t span = whole_rows ? hkv : 1;  // the most kv heads a task
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<__m256> qf(span * group * nv);
    // per query head of the task (kv head, then its group): scores [n rounded up to 8],
    // 1 / the softmax's total, the weighted values' float sums [d]
    std::vector<float> scores, inv(span * group), acc(span * group * d);
    std::vector<int64_t> offs;
    for (int64_t task = claimed.fetch_add(1); task < num_tasks; task = claimed.fetch_add(1)) {
      const int64_t* tile = tiles + 4 * tasks[3 * task];
      const int64_t h0 = tasks[3 * task + 1], h1 = h0 + tasks[3 * task + 2];
      const int64_t heads = (h1 - h0) * group;  // query heads of this task
      const int64_t r = tile[0], row0 = tile[1], rows = tile[2], len0 = tile[3];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len0 - window) : 0;
      const int64_t n = len0 + rows - 1 - first;  // keys [first, first + n) cover the tile
      const int64_t stride = (n + 7) / 8 * 8;
      const int32_t* blocks = table + r * table_stride;
      offs.resize(n);
      scores.resize(heads * stride);
      for (int64_t t = 0, block = first / bs, slot = first % bs; t < n; ++t) {
        offs[t] = ((static_cast<int64_t>(blocks[block]) * bs + slot) * hkv + h0) * d;
        if (++slot == bs) slot = 0, ++block;
      }
      const __m256 scaled = _mm256_set1_ps(scale);
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t len = len0 + j;
        const int64_t a = (window > 0 ? std::max<int64_t>(0, len - window) : 0) - first;
        const int64_t e = len - first, count = e - a;
        for (int64_t x = 0; x < heads; ++x) {  // (the task's query heads are contiguous)
          const at::BFloat16* qj = q + (row0 + j) * q_stride + (h0 * group + x) * d;
          for (int64_t i = 0; i < nv; ++i)
            qf[x * nv + i] = _mm256_mul_ps(load8_bf16(qj + 8 * i), scaled);
        }
        for (int64_t t = a; t < e; t += 8) {  // scores of keys t .. t + 7, each head's from a
          for (int64_t u = t + kAheadAvx2; u < std::min(e, t + kAheadAvx2 + 8); ++u) {
            for (int64_t b = 0; b < (h1 - h0) * d; b += 32)  // fetch K ahead
              _mm_prefetch(reinterpret_cast<const char*>(kc + offs[u] + b), _MM_HINT_T0);
          }
          for (int64_t h = 0; h < h1 - h0; ++h) {
            const at::BFloat16* k[8];
            ASERVE_UNROLL for (int c = 0; c < 8; ++c) k[c] = kc + offs[std::min(t + c, e - 1)] + h * d;
            for (int64_t g0 = 0; g0 < group; g0 += 3) {  // up to 3 heads share K's conversions
              const int64_t g3 = std::min<int64_t>(3, group - g0);
              const __m256* qg = qf.data() + (h * group + g0) * nv;
              __m256 sums[3][8];
              if (g3 == 3) score_keys<3, 4>(qg, nv, k, sums);
              else if (g3 == 2) score_keys<2, 4>(qg, nv, k, sums);
              else score_keys<1, 8>(qg, nv, k, sums);
              for (int64_t g = 0; g < g3; ++g) {
                float* s = scores.data() + (h * group + g0 + g) * stride + t - a;  // (8 fit)
                _mm256_storeu_ps(s, sum8x8(sums[g]));
                if (soft_cap > 0.f)
                  for (int64_t c = 0; c < std::min<int64_t>(8, e - t); ++c)
                    s[c] = soft_cap * std::tanh(s[c] / soft_cap);
              }
            }
          }
        }
        for (int64_t x = 0; x < heads; ++x) {  // probabilities, unnormalized, and their total
          const int64_t head = h0 * group + x;
          float* s = scores.data() + x * stride;
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < count; ++t) top = std::max(top, s[t]);
          if (sinks) top = std::max(top, sinks[head]);
          const __m256 m = _mm256_set1_ps(top);
          __m256 total = _mm256_setzero_ps();
          int64_t t = 0;
          for (; t + 8 <= count; t += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
            _mm256_storeu_ps(s + t, p);
            total = _mm256_add_ps(total, p);
          }
          float sum = sum8(total);
          for (; t < count; ++t) sum += (s[t] = std::exp(s[t] - top));
          if (sinks) sum += std::exp(sinks[head] - top);
          inv[x] = 1.f / sum;
        }
        std::fill(acc.begin(), acc.begin() + heads * d, 0.f);
        const int64_t* row_offs = offs.data() + a;
        for (int64_t k0 = 0; k0 < count; k0 += kChunkAvx2) {  // weighted values: a chunk of
          const int64_t cnt = std::min(kChunkAvx2, count - k0);  // keys for every head
          for (int64_t u = k0 + kChunkAvx2; u < std::min(count, k0 + 2 * kChunkAvx2); ++u)
            for (int64_t b = 0; b < (h1 - h0) * d; b += 32)  // the next chunk's V rows
              _mm_prefetch(reinterpret_cast<const char*>(vc + row_offs[u] + b), _MM_HINT_T0);
          for (int64_t h = 0; h < h1 - h0; ++h) {
            for (int64_t c0 = 0; c0 < nv; c0 += 4) {  // two heads at a time, 4 vectors of d
              const bool whole = nv - c0 >= 4;  // else the last 2 vectors (nv is even)
              for (int64_t g = 0; g < group; g += 2) {
                const int64_t x = h * group + g;
                auto weigh = g + 2 <= group ? (whole ? weigh_values<4, 2> : weigh_values<2, 2>)
                                            : (whole ? weigh_values<4, 1> : weigh_values<2, 1>);
                weigh(scores.data() + x * stride + k0, stride, vc + h * d, row_offs + k0, cnt,
                      c0, acc.data() + x * d, d);
              }
            }
          }
        }
        at::BFloat16* dst = out + ((row0 + j) * hq + h0 * group) * d;
        for (int64_t x = 0; x < heads; ++x) {  // one rounding to bf16 of each output
          const __m256 factor = _mm256_set1_ps(inv[x]);
          for (int64_t i = 0; i < nv; ++i)
            store8_bf16(dst + x * d + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + x * d + 8 * i), factor));
        }
      }
    }
  });
}
#endif

// Whether attend_rows runs here for q [T, Hq, D] (bf16, head_dim % 16 == 0; AVX-512's tiles,
// or the AVX2 tasks).
bool rows_supported(torch::Tensor q) {
#if defined(ASERVE_AVX512) || defined(ASERVE_AVX2)
  return q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.size(2) % 16 == 0 &&
         q.size(2) <= 256;
#else
  return false;
#endif
}

// Attention for every row of the tiles (see attend_tiles_bf16): q [T, Hq, D] (rows may be
// strided: a split of the qkv projection's output), caches [NB, BS, Hkv, D], block_table [R, M]
// int32, tiles [N, 4] int64, out [T, Hq, D], sinks float32 [Hq] or None.
void attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                 torch::Tensor block_table, torch::Tensor tiles, torch::Tensor out, double scale,
                 int64_t window, double soft_cap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(rows_supported(q), "attend_rows: bf16 q [T, Hq, D] with D % 16 == 0 (D <= 256)");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && out.is_contiguous() && block_table.is_contiguous() &&
              tiles.is_contiguous(), "contiguous tensors needed (q: contiguous heads)");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && tiles.scalar_type() == at::kLong,
              "int32 block_table and int64 tiles needed");
  const float* sink_logits = sinks_data(sinks, q.size(1));
#ifdef ASERVE_AVX512
  attend_tiles_bf16(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                    v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                    tiles.data_ptr<int64_t>(), tiles.size(0), out.data_ptr<at::BFloat16>(),
                    q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_table.size(1),
                    q.stride(0), static_cast<float>(scale), window, static_cast<float>(soft_cap),
                    sink_logits);
#elif defined(ASERVE_AVX2)
  attend_tiles_avx2(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                    v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                    tiles.data_ptr<int64_t>(), tiles.size(0), out.data_ptr<at::BFloat16>(),
                    q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_table.size(1),
                    q.stride(0), static_cast<float>(scale), window, static_cast<float>(soft_cap),
                    sink_logits);
#endif
}

// k_cache/v_cache rows [NB * BS, Hkv, D] at slot s = key/value [T, Hkv, D] row t for every
// slot_mapping[t] = s >= 0 (rows may be strided; each row's Hkv * D values contiguous).
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
              torch::Tensor v_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
              value.scalar_type() == v_cache.scalar_type(), "store_kv: cache dtype mismatch");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2) && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong,
              "store_kv: rows of contiguous heads and int64 slots needed");
  const int64_t num = key.size(0), row = key.size(1) * key.size(2);
  const int64_t bytes = row * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(key.data_ptr());
  const char* vs = static_cast<const char*>(value.data_ptr());
  const int64_t kstride = key.stride(0) * key.element_size();
  const int64_t vstride = value.stride(0) * value.element_size();
  const int64_t capacity = k_cache.numel() / row;  // slots in the cache
  for (int64_t t = 0; t < num; ++t) {
    if (slots[t] < 0) continue;
    TORCH_CHECK(slots[t] < capacity, "store_kv: slot ", slots[t], " past the cache's ", capacity);
    std::memcpy(kd + slots[t] * bytes, ks + t * kstride, bytes);
    std::memcpy(vd + slots[t] * bytes, vs + t * vstride, bytes);
  }
}
