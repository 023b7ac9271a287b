// Paged attention decode rows on CPU for any float dtype, a scalar kernel reading K/V straight
// from the paged cache (the C++ of aserve/kernels/paged_attention_cpu.py).
//
// One task per (decode request, kv head): for its G = Hq / Hkv query heads it computes scores
// against every key of the sequence, a float32 softmax, and the weighted sum of values,
// converting bf16/fp16 to float32 in registers:
//
//   block_table[r] = [7, 2, 5]   seq_len = 10, block_size = 4
//   keys t = 0..9 at  k_cache[7][0..3], k_cache[2][0..3], k_cache[5][0..1]   (head h of each)
//
// With a sliding window W only the last W keys are read (from block (seq_len - W) / bs on): the
// blocks before may be freed by a hybrid cache (the null block, or another request's). With
// attention sinks (sinks.h) each head's sink joins its softmax's max and sum.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "sinks.h"

// Dot product with 16 independent partial sums, so that the compiler can vectorize it without
// reassociating one serial float sum (which -O3 alone must not do).
static inline float dot(const float* a, const float* b, int64_t d) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < d; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += part[j];
  return s;
}

template <typename T>
static void decode_rows(const T* q, const T* kc, const T* vc, const int32_t* table,
                        const int32_t* seq_lens, const int64_t* reqs, const int64_t* rows,
                        T* out, int64_t num_rows, int64_t hq, int64_t hkv, int64_t d,
                        int64_t bs, int64_t table_stride, float scale, int64_t window,
                        float soft_cap, const float* sinks) {
  const int64_t group = hq / hkv;
  at::parallel_for(0, num_rows * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t r = reqs[b], row = rows[b];
      const int64_t len = seq_lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int32_t* blocks = table + r * table_stride;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = static_cast<float>(q[(row * hq + h * group + g) * d + i]) * scale;
      scores.assign(group * n, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* k = kc + ((static_cast<int64_t>(blocks[pos / bs]) * bs + pos % bs) * hkv + h) * d;
        float kf[512];
        for (int64_t i = 0; i < d; ++i) kf[i] = static_cast<float>(k[i]);
        for (int64_t g = 0; g < group; ++g) {
          float s = dot(&qf[g * d], kf, d);
          if (soft_cap > 0.f) s = soft_cap * std::tanh(s / soft_cap);
          scores[g * n + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = &scores[g * n];
        float mx = *std::max_element(sg, sg + n);
        float sum = 0.f;
        if (sinks) {  // the sink's logit: in the max and the sum, with no value
          const float sink = sinks[h * group + g];
          mx = std::max(mx, sink);
          sum = std::exp(sink - mx);
        }
        for (int64_t t = 0; t < n; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* v = vc + ((static_cast<int64_t>(blocks[pos / bs]) * bs + pos % bs) * hkv + h) * d;
        float vf[512];
        for (int64_t i = 0; i < d; ++i) vf[i] = static_cast<float>(v[i]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* ag = &acc[g * d];
          for (int64_t i = 0; i < d; ++i) ag[i] += p * vf[i];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          out[(row * hq + h * group + g) * d + i] = static_cast<T>(acc[g * d + i]);
    }
  });
}

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor reqs,
                  torch::Tensor rows, torch::Tensor out, double scale, int64_t window,
                  double soft_cap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              out.is_contiguous() && block_table.is_contiguous(), "contiguous tensors needed");
  TORCH_CHECK(q.size(2) <= 512, "head_dim must be at most 512");
  const float* sink_logits = sinks_data(sinks, q.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                          v_cache.data_ptr<scalar_t>(), block_table.data_ptr<int32_t>(),
                          seq_lens.data_ptr<int32_t>(), reqs.data_ptr<int64_t>(),
                          rows.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), reqs.size(0),
                          q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                          block_table.size(1), static_cast<float>(scale), window,
                          static_cast<float>(soft_cap), sink_logits);
  });
}
