"""Paged attention on CPU: decode rows through a small C++ kernel that reads K/V straight from
the paged cache (no gathered copy of each sequence), prefill chunks as in the reference.

The kernel is compiled on first use with `torch.utils.cpp_extension.load_inline` (needs a C++
compiler and ninja; the build is cached under the torch extensions directory, keyed by this
CPU's instruction-set flags since it is built with `-march=native`). When it cannot be built,
`paged_attention_cpu` falls back to `paged_attention_ref`, its oracle, with a warning.

One task per (decode request, kv head): for its G = Hq / Hkv query heads it computes scores
against every key of the sequence block by block, a float32 softmax, and the weighted sum of
values, converting bf16/fp16 to float32 in registers:

    block_table[r] = [7, 2, 5]   seq_len = 10, block_size = 4
    keys t = 0..9 at  k_cache[7][0..3], k_cache[2][0..3], k_cache[5][0..1]   (head h of each)
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform

import torch

from aserve.kernels.cpu_simd import PRELUDE
from aserve.kernels.paged_attention import attend_chunks, batch_layout, paged_attention_ref

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
""" + PRELUDE + r"""

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

#ifdef ASERVE_AVX512
// o[g, 16c : 16(c+P)] = inv[g] * sum_t p[g, t] * v_t[16c : 16(c+P)] for G query heads and P
// 16-wide chunks of head_dim, all G*P accumulators in registers (G, P known at compile time).
template <int G, int P>
static void weighted_values(const at::BFloat16* vc, const int64_t* offs, int64_t n,
                            const float* p, int64_t p_stride, int64_t c, const float* inv,
                            at::BFloat16* o, int64_t o_stride) {
  __m512 acc[G][P];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < P; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[P];
    for (int j = 0; j < P; ++j) v[j] = load_bf16(vc + offs[t] + 16 * (c + j));
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
      for (int j = 0; j < P; ++j) acc[g][j] = _mm512_fmadd_ps(pg, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < P; ++j)
      store_bf16(o + g * o_stride + 16 * (c + j), _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));
}

using WeightedValues = void (*)(const at::BFloat16*, const int64_t*, int64_t, const float*,
                                int64_t, int64_t, const float*, at::BFloat16*, int64_t);
// Indexed by the number of query heads in a tile (1..8).
static const WeightedValues kWeightedPairs[9] = {
    nullptr, weighted_values<1, 2>, weighted_values<2, 2>, weighted_values<3, 2>,
    weighted_values<4, 2>, weighted_values<5, 2>, weighted_values<6, 2>, weighted_values<7, 2>,
    weighted_values<8, 2>};
static const WeightedValues kWeightedSingles[9] = {
    nullptr, weighted_values<1, 1>, weighted_values<2, 1>, weighted_values<3, 1>,
    weighted_values<4, 1>, weighted_values<5, 1>, weighted_values<6, 1>, weighted_values<7, 1>,
    weighted_values<8, 1>};

// bf16 with head_dim a multiple of 16 (at most 256): K and V rows are converted in registers,
// each score is one vector dot product, softmax and the weighted sum of values are vectorized,
// and every cache row is found once per task (offs[t]).
static void decode_rows_bf16(const at::BFloat16* q, const at::BFloat16* kc,
                             const at::BFloat16* vc, const int32_t* table,
                             const int32_t* seq_lens, const int64_t* reqs, const int64_t* rows,
                             at::BFloat16* out, int64_t num_rows, int64_t hq, int64_t hkv,
                             int64_t d, int64_t bs, int64_t table_stride, float scale,
                             int64_t window, float soft_cap) {
  const int64_t group = hq / hkv, chunks = d / 16, words = (d + 31) / 32;
  constexpr int64_t kTile = 8;  // query heads whose accumulators stay in registers
  at::parallel_for(0, num_rows * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), scores;
    std::vector<int64_t> offs;
    std::vector<__m512> part(group * 16, _mm512_setzero_ps());
    std::vector<__m512i> qw(group * words);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t r = reqs[b], row = rows[b];
      const int64_t len = seq_lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int32_t* blocks = table + r * table_stride;
      offs.resize(n);
      for (int64_t t = 0, j = first / bs, o = first % bs; t < n; ++j, o = 0)
        for (const int64_t base = static_cast<int64_t>(blocks[j]) * bs; o < bs && t < n; ++o)
          offs[t++] = ((base + o) * hkv + h) * d;
      const at::BFloat16* qh = q + (row * hq + h * group) * d;
#ifdef __AVX512BF16__
      // bf16 pairs straight into dpbf16 (exact products, float32 sums); scaled afterwards
      for (int64_t g = 0; g < group; ++g)
        for (int64_t w = 0; w < words; ++w)
          qw[g * words + w] = _mm512_maskz_loadu_epi16(word_mask(d - 32 * w), qh + g * d + 32 * w);
      const float qk_scale = scale;
#else
      for (int64_t i = 0; i < group * d; i += 16)
        _mm512_storeu_ps(&qf[i], _mm512_mul_ps(load_bf16(qh + i), _mm512_set1_ps(scale)));
      const float qk_scale = 1.f;
#endif
      scores.resize(group * n);
      // Scores 16 keys at a time: one partial-sum vector per (query head, key), then sum16
      // turns 16 of them into 16 scores at once.
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - t0);
        for (int64_t i = 0; i < cnt; ++i) {
          const at::BFloat16* k = kc + offs[t0 + i];
#ifdef __AVX512BF16__
          __m512i kw[8];
          for (int64_t w = 0; w < words; ++w)
            kw[w] = _mm512_maskz_loadu_epi16(word_mask(d - 32 * w), k + 32 * w);
          for (int64_t g = 0; g < group; ++g) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t w = 0; w < words; ++w)
              a = _mm512_dpbf16_ps(a, (__m512bh)qw[g * words + w], (__m512bh)kw[w]);
            part[g * 16 + i] = a;
          }
#else
          __m512 kv[16];
          for (int64_t c = 0; c < chunks; ++c) kv[c] = load_bf16(k + 16 * c);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = &qf[g * d];
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
            for (int64_t c = 1; c < chunks; ++c)
              a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], a);
            part[g * 16 + i] = a;
          }
#endif
        }
        for (int64_t g = 0; g < group; ++g) {
          __m512 sc = _mm512_mul_ps(sum16(&part[g * 16]), _mm512_set1_ps(qk_scale));
          if (soft_cap > 0.f) {
            alignas(64) float tmp[16];
            _mm512_store_ps(tmp, sc);
            for (float& x : tmp) x = soft_cap * std::tanh(x / soft_cap);
            sc = _mm512_load_ps(tmp);
          }
          _mm512_mask_storeu_ps(&scores[g * n + t0], tail_mask(cnt), sc);
        }
      }
      std::vector<float> inv(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = &scores[g * n];
        __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < n; t += 16)
          mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(n - t), sg + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 tm = tail_mask(n - t);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tm, sg + t), m));
          _mm512_mask_storeu_ps(sg + t, tm, e);
          sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tm, e));
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(sum);
      }
      for (int64_t g0 = 0; g0 < group; g0 += kTile) {
        const int64_t tile = std::min(kTile, group - g0);
        at::BFloat16* o = out + (row * hq + h * group + g0) * d;
        for (int64_t c = 0; c < chunks; c += 2)
          (c + 1 < chunks ? kWeightedPairs : kWeightedSingles)[tile](
              vc, offs.data(), n, &scores[g0 * n], n, c, &inv[g0], o, d);
      }
    }
  });
}
#endif

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor reqs,
                  torch::Tensor rows, torch::Tensor out, double scale, int64_t window,
                  double soft_cap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              out.is_contiguous() && block_table.is_contiguous(), "contiguous tensors needed");
  TORCH_CHECK(q.size(2) <= 512, "head_dim must be at most 512");
#ifdef ASERVE_AVX512
  if (q.scalar_type() == at::kBFloat16 && q.size(2) % 16 == 0 && q.size(2) <= 256) {
    decode_rows_bf16(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                     v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                     seq_lens.data_ptr<int32_t>(), reqs.data_ptr<int64_t>(),
                     rows.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), reqs.size(0),
                     q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                     block_table.size(1), static_cast<float>(scale), window,
                     static_cast<float>(soft_cap));
    return;
  }
#endif
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

_built: dict[str, object] = {}  # extension name -> module, or None when the build failed


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary may not be on it (pyenv shims
    appear only after a rehash, a venv's bin only when activated)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def build_extension(name: str, source: str, functions: list[str]):
    """Compile (or load the cached build of) a C++ extension for this CPU; None if it cannot
    be built here (no compiler or ninja), with one warning."""
    if name in _built:
        return _built[name]
    from torch.utils.cpp_extension import load_inline

    _put_ninja_on_path()
    key = hashlib.sha256((source + _cpu_flags() + torch.__version__).encode()).hexdigest()[:12]
    try:
        module = load_inline(
            name=f"{name}_{key}", cpp_sources=[source], functions=functions,
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the references still work
        module = None
        logger.warning("The C++ CPU extension %s could not be built (%s); using the torch "
                       "references instead.", name, e)
    _built[name] = module
    return module


def load_kernel():
    """The compiled attention extension, or None if it cannot be built here."""
    return build_extension("aserve_cpu_attention", _SOURCE, ["paged_decode"])


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
