// Fused bfloat16 element-wise ops for CPU (the C++ of aserve/kernels/cpu_elementwise.py):
//
//   rms_norm       residual-add + RMSNorm, in place
//   rope           neox-style RoPE, in place
//   silu_and_mul   silu(gate) * up
//   gelu_tanh_and_mul   gelu_tanh(gate) * up
//   swiglu_oai_and_mul  gpt-oss' clamped (up + 1) * gate * sigmoid(alpha gate)
//   argmax_rows    torch.argmax of each float32 row
//
// Each is one loop where torch would dispatch a dozen tiny ops (AVX-512: 16 lanes; AVX2:
// rms_norm, rope and argmax_rows 8 lanes, the gated ones one value at a time). Every op rounds
// to bfloat16 where the torch formulation (cpu_elementwise's *_ref twins) does, so results match
// it to the last bit in almost every element (float32 reductions may differ in order).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "activation.h"
#include "simd.h"

using bf16 = at::BFloat16;
static inline float f(bf16 v) { return static_cast<float>(v); }

// residual = bf16(x + residual); x = bf16(w * bf16(residual * rsqrt(mean(residual^2) + eps)))
// (without a residual: x = the norm of x). Rows of `hidden` elements, contiguous.
void rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
              double eps) {
  const int64_t n = weight.size(0), rows = x.numel() / n;
  bf16* xp = x.data_ptr<bf16>();
  bf16* rp = residual.has_value() ? residual->data_ptr<bf16>() : nullptr;
  const bf16* wp = weight.data_ptr<bf16>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* xr = xp + r * n;
      bf16* src = rp != nullptr ? rp + r * n : xr;
#ifdef ASERVE_AVX512
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        __m512 a = load_bf16(xr + i, m);
        if (rp != nullptr) {
          a = round_bf16(_mm512_add_ps(a, load_bf16(src + i, m)));
          store_bf16(src + i, a, m);
        }
        ss = _mm512_fmadd_ps(a, a, ss);
      }
      const __m512 inv = _mm512_set1_ps(
          1.f / std::sqrt(_mm512_reduce_add_ps(ss) / n + static_cast<float>(eps)));
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 y = round_bf16(_mm512_mul_ps(load_bf16(src + i, m), inv));
        store_bf16(xr + i, _mm512_mul_ps(load_bf16(wp + i, m), y), m);
      }
#else
      int64_t i = 0;  // (AVX2: 8 lanes, then the scalar loop for the row's tail)
      float ss = 0.f;
#ifdef ASERVE_AVX2
      __m256 ss8 = _mm256_setzero_ps();
      for (; i + 8 <= n; i += 8) {
        __m256 a = load8_bf16(xr + i);
        if (rp != nullptr) {
          a = round8_bf16(_mm256_add_ps(a, load8_bf16(src + i)));
          store8_bf16(src + i, a);
        }
        ss8 = _mm256_fmadd_ps(a, a, ss8);
      }
      ss = sum8(ss8);
#endif
      for (int64_t j = i; j < n; ++j) {
        if (rp != nullptr) src[j] = bf16(f(xr[j]) + f(src[j]));
        ss += f(src[j]) * f(src[j]);
      }
      const float inv = 1.f / std::sqrt(ss / n + static_cast<float>(eps));
      i = 0;
#ifdef ASERVE_AVX2
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (; i + 8 <= n; i += 8) {
        const __m256 y = round8_bf16(_mm256_mul_ps(load8_bf16(src + i), inv8));
        store8_bf16(xr + i, _mm256_mul_ps(load8_bf16(wp + i), y));
      }
#endif
      for (; i < n; ++i) xr[i] = bf16(f(wp[i]) * f(bf16(f(src[i]) * inv)));
#endif
    }
  });
}

// In place on rows x[t, h*head_dim : ...] (row stride given): neox RoPE over the first
// `rot` dims with cos/sin caches [max_pos, rot] (their halves repeat).
void rope(torch::Tensor positions, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
          int64_t head_dim, int64_t rot) {
  const int64_t tokens = x.size(0), heads = x.size(1) / head_dim, stride = x.stride(0);
  const int64_t half = rot / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  bf16* xp = x.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cp + pos[t] * rot;
      const bf16* s = sp + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* v = xp + t * stride + h * head_dim;
#ifdef ASERVE_AVX512
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = load_bf16(v + i, m), x2 = load_bf16(v + i + half, m);
          const __m512 c1 = load_bf16(c + i, m), c2 = load_bf16(c + i + half, m);
          const __m512 s1 = load_bf16(s + i, m), s2 = load_bf16(s + i + half, m);
          const __m512 nx2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
          store_bf16(v + i, _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)),
                                          round_bf16(_mm512_mul_ps(nx2, s1))), m);
          store_bf16(v + i + half, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)),
                                                 round_bf16(_mm512_mul_ps(x1, s2))), m);
        }
#else
        int64_t i = 0;
#ifdef ASERVE_AVX2
        for (; i + 8 <= half; i += 8) {  // the scalar loop's roundings, 8 lanes
          const __m256 x1 = load8_bf16(v + i), x2 = load8_bf16(v + i + half);
          const __m256 c1 = load8_bf16(c + i), c2 = load8_bf16(c + i + half);
          const __m256 s1 = load8_bf16(s + i), s2 = load8_bf16(s + i + half);
          const __m256 nx2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
          store8_bf16(v + i, _mm256_add_ps(round8_bf16(_mm256_mul_ps(x1, c1)),
                                           round8_bf16(_mm256_mul_ps(nx2, s1))));
          store8_bf16(v + i + half, _mm256_add_ps(round8_bf16(_mm256_mul_ps(x2, c2)),
                                                  round8_bf16(_mm256_mul_ps(x1, s2))));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = f(v[i]), x2 = f(v[i + half]);
          v[i] = bf16(f(bf16(x1 * f(c[i]))) + f(bf16(-x2 * f(s[i]))));
          v[i + half] = bf16(f(bf16(x2 * f(c[i + half]))) + f(bf16(x1 * f(s[i + half]))));
        }
#endif
      }
    }
  });
}

// out[t, i] = bf16(act(gate[t, i], up[t, i])) for x = [gate | up], rows contiguous: `act` one
// of activation.h's gated activations (16 lanes at a time with AVX-512, else one by one).
template <typename Act>
void gated_rows(torch::Tensor out, torch::Tensor x, Act act) {
  const int64_t d = out.size(-1), rows = out.numel() / d;
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = xp + r * 2 * d;
#ifdef ASERVE_AVX512
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = tail_mask(d - i);
        store_bf16(op + r * d + i, act(load_bf16(g + i, m), load_bf16(g + d + i, m)), m);
      }
#else
      for (int64_t i = 0; i < d; ++i) op[r * d + i] = bf16(act(f(g[i]), f(g[d + i])));
#endif
    }
  });
}

void silu_and_mul(torch::Tensor out, torch::Tensor x) { gated_rows(out, x, SiluMul{}); }

// Bit-equal to torch's CPU bf16 F.gelu(gate, approximate="tanh") * up but where activation.h
// says (subnormal results; row tails, where torch's tanh is glibc's).
void gelu_tanh_and_mul(torch::Tensor out, torch::Tensor x) {
  gated_rows(out, x, GeluTanhMul{});
}

// gpt-oss' clamped SwiGLU (`limit` infinite: no clamp).
void swiglu_oai_and_mul(torch::Tensor out, torch::Tensor x, double alpha, double limit) {
  gated_rows(out, x, SwigluOaiMul(alpha, limit));
}

// out[r] = the first index of row r's maximum, as torch.argmax (a NaN counts as the maximum:
// the first NaN's index). x [R, V] float32, contiguous.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "argmax_rows: a contiguous float32 [R, V]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = xp + r * n;
      int64_t best = 0;
      bool nan = false;
#ifdef ASERVE_AVX512
      const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512 mx = neg_inf;
      __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                   10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      __mmask16 any_nan = 0;
      for (int64_t i = 0; i < n; i += 16) {  // per lane: the first strictly greater value
        const __m512 a = _mm512_mask_loadu_ps(neg_inf, tail_mask(n - i), v + i);
        any_nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(a, mx, _CMP_GT_OQ);
        mx = _mm512_mask_mov_ps(mx, gt, a);
        at = _mm512_mask_mov_epi32(at, gt, idx);
        idx = _mm512_add_epi32(idx, step);
      }
      nan = any_nan != 0;
      if (!nan) {  // the lowest index among the lanes holding the maximum
        const float m = _mm512_reduce_max_ps(mx);
        const __mmask16 top = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(top, at);
      }
#else
      float m = v[0];
      int64_t i = 0;
#ifdef ASERVE_AVX2
      if (n >= 8) {  // as the AVX-512 loop, 8 lanes; the row's tail below
        __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        __m256 any_nan = _mm256_setzero_ps();
        __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        for (; i + 8 <= n; i += 8) {
          const __m256 a = _mm256_loadu_ps(v + i);
          any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
          const __m256 gt = _mm256_cmp_ps(a, mx, _CMP_GT_OQ);
          mx = _mm256_blendv_ps(mx, a, gt);
          at = _mm256_castps_si256(
              _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
          idx = _mm256_add_epi32(idx, step);
        }
        nan = _mm256_movemask_ps(any_nan) != 0;
        if (!nan) {  // the lowest index among the lanes holding the maximum
          alignas(32) float lanes[8];
          alignas(32) int32_t where[8];
          _mm256_store_ps(lanes, mx);
          _mm256_store_si256(reinterpret_cast<__m256i*>(where), at);
          m = lanes[0];
          for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
          best = n;
          for (int l = 0; l < 8; ++l)
            if (lanes[l] == m) best = std::min<int64_t>(best, where[l]);
        }
      }
#endif
      for (; i < n && !nan; ++i) {
        if (std::isnan(v[i])) nan = true;
        else if (v[i] > m) { m = v[i]; best = i; }
      }
#endif
      if (nan)
        for (int64_t i = 0; i < n; ++i)
          if (std::isnan(v[i])) { best = i; break; }
      op[r] = best;
    }
  });
  return out;
}
