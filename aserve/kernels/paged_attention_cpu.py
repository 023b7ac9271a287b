"""Paged attention on CPU for any float dtype: decode rows through a scalar C++ kernel (in the
extension of `cpu_simd.load`) that reads K/V straight from the paged cache, prefill chunks through
SDPA as in the reference. The fallback of `cpu_attention.cpu_attention_forward` where its
AVX-512 row-tile kernel does not apply (fp16, no AVX-512, head_dim % 16); without a C++
toolchain, `paged_attention_ref`, its oracle.

One task per (decode request, kv head): for its G = Hq / Hkv query heads it computes scores
against every key of the sequence, a float32 softmax, and the weighted sum of values, converting
bf16/fp16 to float32 in registers:

    block_table[r] = [7, 2, 5]   seq_len = 10, block_size = 4
    keys t = 0..9 at  k_cache[7][0..3], k_cache[2][0..3], k_cache[5][0..1]   (head h of each)
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_simd
from aserve.kernels.paged_attention import attend_chunks, batch_layout, paged_attention_ref

SOURCE = r"""
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
                        float soft_cap) {
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
        const float mx = *std::max_element(sg, sg + n);
        float sum = 0.f;
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
                  double soft_cap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              out.is_contiguous() && block_table.is_contiguous(), "contiguous tensors needed");
  TORCH_CHECK(q.size(2) <= 512, "head_dim must be at most 512");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                          v_cache.data_ptr<scalar_t>(), block_table.data_ptr<int32_t>(),
                          seq_lens.data_ptr<int32_t>(), reqs.data_ptr<int64_t>(),
                          rows.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), reqs.size(0),
                          q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                          block_table.size(1), static_cast<float>(scale), window,
                          static_cast<float>(soft_cap));
  });
}
"""

FUNCTIONS = ["paged_decode"]


def load_kernel():
    """The compiled CPU extension (`cpu_simd.load`), or None if it cannot be built here."""
    return cpu_simd.load()


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        out: torch.Tensor | None = None, *,
                        query_start_loc_cpu: list[int] | None = None,
                        seq_lens_cpu: list[int] | None = None,
                        key: torch.Tensor | None = None,
                        value: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_ref`'s signature and results; decode rows run the C++ kernel."""
    module = load_kernel() if q.device.type == "cpu" else None
    if module is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return paged_attention_ref(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, sliding_window,
            soft_cap, out, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
            key=key, value=value)
    q = q.contiguous()
    starts, lens, decodes, out = batch_layout(q, k_cache, query_start_loc, seq_lens, out,
                                              query_start_loc_cpu, seq_lens_cpu)
    if decodes:
        target = out if out.is_contiguous() else torch.empty_like(q)
        module.paged_decode(
            q, k_cache, v_cache, block_table.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), torch.tensor(decodes, dtype=torch.int64),
            torch.tensor([starts[r] for r in decodes], dtype=torch.int64), target, scale,
            sliding_window or 0, soft_cap or 0.0)
        if target is not out:
            rows = [starts[r] for r in decodes]
            out[rows] = target[rows]
    attend_chunks(q, k_cache, v_cache, starts, lens, block_table, scale, sliding_window,
                  soft_cap, out, key, value)
    return out
