// The gated activations out = act(gate, up) of an MLP's [gate | up], as torch computes them in
// bf16 (each op rounds to bf16 where torch's bf16 ops do), shared by the element-wise ops
// (elementwise.h: gated_rows) and the GEMM's gated epilogues (gemm.h: store_tile):
//
//   SiluMul        bf16(silu(g)) * u                              silu(a) = a / (1 + e^-a)
//   GeluTanhMul    bf16(gelu_tanh(g)) * u                         (torch's CPU formulation)
//   SwigluOaiMul   gpt-oss: g = min(g, limit), u = clamp(u, -limit, limit),
//                  bf16(u + 1) * bf16(g * bf16(sigmoid(bf16(alpha g))))
//
// Each takes the gate and up values (bf16 values, as float) and returns the float result before
// its final rounding to bf16, which the caller's store does: 16 lanes at a time where the build
// has AVX-512, one value at a time otherwise.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "simd.h"

// The float nearest bf16 value (round to nearest even): the scalar twin of round_bf16(__m512).
static inline float round_bf16(float x) { return static_cast<float>(at::BFloat16(x)); }

// Below this gate exp8 (clamped at 88.3) no longer gives silu's float result.
constexpr float kSiluExact8 = -88.f;

struct SiluMul {
#ifdef ASERVE_AVX512
  __m512 operator()(__m512 g, __m512 u) const {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e))), u);
  }
#endif
#ifdef ASERVE_YMM
  // 8 lanes, as the AVX-512 form; for a gate under kSiluExact8 exp8's clamp would change the
  // result, and callers take the scalar form for such lanes.
  __m256 operator()(__m256 g, __m256 u) const {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(round8_bf16(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e))), u);
  }
#endif
  float operator()(float g, float u) const { return round_bf16(g / (1.f + std::exp(-g))) * u; }
};

// gelu_tanh(a) = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), in float32 of the bf16 gate in
// torch's order of operations. torch's tanh is Sleef's tanhf (1 ulp, and exactly +-1 beyond
// |x| > 8.664339742, which this copies); tanh16's error is absolute (~1e-7), which after the
// rounding to bf16 leaves no difference over all 65,536 gate values but one: a float result below
// FLT_MIN is a zero here (vcvtneps2bf16 flushes subnormals). torch's row tails (its scalar loop)
// use glibc's tanh instead, one float ulp off at times.
struct GeluTanhMul {
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
  static constexpr float kSaturate = 8.664339742f;  // Sleef: tanh = +-1 beyond
#ifdef ASERVE_AVX512
  __m512 operator()(__m512 a, __m512 u) const {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(a, a), a);
    const __m512 inner = _mm512_mul_ps(
        _mm512_set1_ps(kBeta), _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(kKappa), cube)));
    const __mmask16 flat =
        _mm512_cmp_ps_mask(_mm512_abs_ps(inner), _mm512_set1_ps(kSaturate), _CMP_GT_OQ);
    const __m512 t = _mm512_mask_mov_ps(
        tanh16(inner), flat, _mm512_or_ps(_mm512_and_ps(inner, _mm512_set1_ps(-0.f)), one));
    const __m512 act = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), a), _mm512_add_ps(one, t));
    return _mm512_mul_ps(round_bf16(act), u);
  }
#endif
  float operator()(float a, float u) const {
    const float inner = kBeta * (a + kKappa * (a * a * a));
    const float t = std::abs(inner) > kSaturate ? std::copysign(1.f, inner) : std::tanh(inner);
    return round_bf16(0.5f * a * (1.f + t)) * u;
  }
};

// gpt-oss' clamped SwiGLU, as `aserve.kernels.moe.apply_activation` computes it in bf16 (the
// limit rounded to bf16 clamps a bf16 value exactly as torch's clamp does); no limit: infinity.
struct SwigluOaiMul {
  float alpha, limit;
  SwigluOaiMul(double alpha_, double limit_)
      : alpha(static_cast<float>(alpha_)), limit(round_bf16(static_cast<float>(limit_))) {}
#ifdef ASERVE_AVX512
  __m512 operator()(__m512 g, __m512 u) const {
    const __m512 one = _mm512_set1_ps(1.f), top = _mm512_set1_ps(limit);
    g = _mm512_min_ps(top, g);  // a NaN operand: the second one, so NaN stays NaN
    u = _mm512_max_ps(_mm512_set1_ps(-limit), _mm512_min_ps(top, u));
    const __m512 a = round_bf16(_mm512_mul_ps(g, _mm512_set1_ps(alpha)));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
    const __m512 sig = round_bf16(_mm512_div_ps(one, _mm512_add_ps(one, e)));
    return _mm512_mul_ps(round_bf16(_mm512_add_ps(u, one)), round_bf16(_mm512_mul_ps(g, sig)));
  }
#endif
  float operator()(float g, float u) const {
    g = std::isnan(g) ? g : std::min(g, limit);
    u = std::isnan(u) ? u : std::max(-limit, std::min(u, limit));
    const float sig = round_bf16(1.f / (1.f + std::exp(-round_bf16(g * alpha))));
    return round_bf16(u + 1.f) * round_bf16(g * sig);
  }
};
