// Weight-only int8 / int6 / int4 GEMM for CPUs with AVX512-VNNI: y = x @ W^T (+ b) where W is stored
// as unsigned integers with a scale and a min per group of G inputs (the C++ of
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
// Packing, once at load, into the bf16 GEMM's panels of 48 outputs (gemm.h's panel_lane, so a
// gated [gate; up] pairs its halves the same way and shares its epilogues); each (panel, group)
// is one run of bytes read front to back:
//
//   8 bits: data[kq, v, j, t]  = q[48 p + 16 v + j, G g + 4 kq + t]                  (48 G bytes)
//   4 bits: data[k8, v, j, t]  = q[.., G g + 8 k8 + t] | q[.., G g + 8 k8 + 4 + t] << 4 (24 G)
//   6 bits: 4 bits' layout of the low nibbles (24 G), then the top two bits of 16 inputs a
//           byte run: high[k16, v, j, t] = sum_s (q[.., G g + 16 k16 + 4 s + t] >> 4) << 2 s
//           (12 G; Q6_K, and the 5-bit types, in 6/8 of int8's bytes)
//   then scale[48] and min[48] as fp16 (192 bytes); or, symmetric (a weight whose min is
//   -2^(bits-1) scale in every group: Q8_0, Q4_0, Q6_K, GPTQ without zero points), the scales
//   alone (96 bytes), the min computed as -2^(bits-1) scale
//
// A packed weight is uint8 [panels, K / G, group bytes]: K / G and the group's bytes say G, the
// bits and whether mins are stored (no two of the six sizes meet for G a multiple of 16), so the
// tensor describes itself. The micro-kernel keeps 4 rows x 48 outputs of int32
// sums for a group and of float sums across groups (24 registers), and stores through gemm.h's
// store_tile, so bias, bf16 rounding and the gated SiLU epilogue are the bf16 GEMM's. With one
// or two rows (decode), int4's high nibbles go into sums of their own as they lie (16 q), so
// no shift a vector; GGUF's groups (16, 32) have their k-loops unrolled whole.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm.h"

#if defined(ASERVE_GEMM) && defined(__AVX512VNNI__)
#define ASERVE_QGEMM 1
#endif

constexpr int64_t kQuantMeta = 2 * kPanel * 2;  // bytes of a group's 48 fp16 scales and mins
constexpr int64_t kQuantScales = kPanel * 2;    // a symmetric group's: its 48 scales
constexpr int64_t kQRows = 4;                   // rows of a micro-kernel tile

bool qgemm_supported() {
#ifdef ASERVE_QGEMM
  return true;
#else
  return false;
#endif
}

struct QuantLayout {
  int64_t group, bits, group_bytes, groups;
  float zero;  // symmetric: the min is -zero * scale (2^(bits-1)); 0: mins are stored
};

static inline int64_t quant_group_bytes(int64_t G, int64_t bits, bool symmetric = false) {
  return kPanel * G * bits / 8 + (symmetric ? kQuantScales : kQuantMeta);
}

// G and the bits of a packed weight [panels, K / G, group bytes] over K inputs.
static QuantLayout quant_layout(const torch::Tensor& packed, int64_t K) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "qgemm: a packed weight is a contiguous uint8 [panels, groups, group bytes]");
  const int64_t groups = packed.size(1), gb = packed.size(2);
  TORCH_CHECK(groups > 0 && K % groups == 0, "qgemm: ", K, " inputs in ", groups, " groups");
  const int64_t G = K / groups;
  int64_t bits = 0;
  bool symmetric = false;
  for (const int64_t b : {4, 6, 8})
    for (const bool sym : {false, true})
      if (gb == quant_group_bytes(G, b, sym)) bits = b, symmetric = sym;
  TORCH_CHECK(bits != 0 && G % 16 == 0, "qgemm: group bytes ", gb, " fit no layout of G = ", G);
  return {G, bits, gb, groups, symmetric ? static_cast<float>(int64_t{1} << (bits - 1)) : 0.f};
}

// q [N, K] uint8 (values < 2^bits), scale / min [N, K / G] fp16 -> uint8 [panels, K / G, group
// bytes]. `gated`: q is [gate; up], packed as panel_lane pairs them. No mins: symmetric, the
// min of every group -2^(bits-1) scale (the caller has checked that it is).
torch::Tensor qgemm_pack(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> mins_,
                         int64_t bits, bool gated) {
  const bool symmetric = !mins_.has_value();
  torch::Tensor mins = symmetric ? scale : *mins_;
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "qgemm_pack: q is uint8 [N, K]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "qgemm_pack: 4, 6 or 8 bits, not ", bits);
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) > 0 &&
                  scale.sizes() == mins.sizes() && scale.scalar_type() == at::kHalf &&
                  mins.scalar_type() == at::kHalf,
              "qgemm_pack: fp16 scale and min of [N, K / G]");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 16 == 0,
              "qgemm_pack: the group size must divide K and be a multiple of 16");
  TORCH_CHECK(!gated || N % 2 == 0, "qgemm_pack: a gated weight has 2 d rows");
  TORCH_CHECK(N == 0 || q.max().item<int64_t>() < (int64_t{1} << bits),
              "qgemm_pack: a value does not fit ", bits, " bits");
  q = q.contiguous(), scale = scale.contiguous(), mins = mins.contiguous();
  const int64_t G = K / groups, d = N / 2, gb = quant_group_bytes(G, bits, symmetric);
  const int64_t panels = gated ? (d + kHalf - 1) / kHalf : (N + kPanel - 1) / kPanel;
  auto out = torch::zeros({panels, groups, gb}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  const at::Half* sc = scale.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t p, lane;  // lane = 16 v + j: each byte below is this row's alone
      panel_lane(n, gated, d, p, lane);
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* base = dst + (p * groups + g) * gb;
        const uint8_t* row = src + n * K + g * G;
        uint8_t* high = base + kPanel * G / 2;  // 6 bits: the top two bits' run
        for (int64_t k = 0; k < G; ++k) {
          if (bits == 8) {
            base[((k / 4) * kPanel + lane) * 4 + k % 4] = row[k];
            continue;
          }
          base[((k / 8) * kPanel + lane) * 4 + k % 4] |= (row[k] & 0x0F) << (4 * ((k % 8) / 4));
          if (bits == 6)
            high[((k / 16) * kPanel + lane) * 4 + k % 4] |= (row[k] >> 4) << (2 * ((k % 16) / 4));
        }
        at::Half* meta = reinterpret_cast<at::Half*>(base + kPanel * G * bits / 8);
        meta[lane] = sc[n * groups + g];
        if (!symmetric) meta[kPanel + lane] = mn[n * groups + g];
      }
    }
  });
  return out;
}

// W's rows `rows` as float32 [len(rows), K] (scale * q + min), read back from the packed layout
// (tests; a quantized embedding's lookup). N: W's rows; gated: as packed.
torch::Tensor qgemm_rows(torch::Tensor packed, int64_t N, int64_t K, bool gated,
                         torch::Tensor rows) {
  const QuantLayout L = quant_layout(packed, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "qgemm_rows: int64 rows");
  rows = rows.contiguous();
  const int64_t R = rows.size(0), G = L.group, d = N / 2;
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < N, "qgemm_rows: row ", ids[i], " of ", N);
  auto out = torch::empty({R, K}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t p, lane;
      panel_lane(ids[i], gated, d, p, lane);
      for (int64_t g = 0; g < L.groups; ++g) {
        const uint8_t* base = src + (p * L.groups + g) * L.group_bytes;
        const at::Half* meta = reinterpret_cast<const at::Half*>(base + kPanel * G * L.bits / 8);
        const float s = meta[lane];
        const float m = L.zero > 0.f ? -L.zero * s : static_cast<float>(meta[kPanel + lane]);
        const uint8_t* high = base + kPanel * G / 2;
        for (int64_t k = 0; k < G; ++k) {
          int q = L.bits == 8 ? base[((k / 4) * kPanel + lane) * 4 + k % 4]
                              : (base[((k / 8) * kPanel + lane) * 4 + k % 4] >>
                                 (4 * ((k % 8) / 4))) & 0x0F;
          if (L.bits == 6)
            q |= ((high[((k / 16) * kPanel + lane) * 4 + k % 4] >> (2 * ((k % 16) / 4))) & 3)
                 << 4;
          dst[i * K + g * G + k] = s * static_cast<float>(q) + m;
        }
      }
    }
  });
  return out;
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

// c[0:R, 0:cols] = rows [0, R) of x (quantized: xq with stride K, xs / xsum with stride
// `groups`) @ one packed panel, stored by epilogue E.
template <int R, int Bits, int E, int FixedG>
static void qtile(const int8_t* xq, int64_t K, const float* xs, const float* xsum,
                  int64_t groups, const uint8_t* panel, int64_t group, int64_t gb, float zero,
                  void* c, int64_t ldc, int64_t cols, const TileEpilogue& ep) {
  const int64_t G = FixedG > 0 ? FixedG : group;  // fixed: the k-loops unroll whole
  __m512 acc[R][kVecs];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = panel + g * gb;
    const int8_t* x = xq + g * G;
    __m512i dot[R][kVecs];
    ASERVE_UNROLL for (int r = 0; r < R; ++r)
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) dot[r][v] = _mm512_setzero_si512();
    if (Bits == 6 && R > 2) {
      // many rows: each quad of inputs made whole once (nibble | 16 h, as in the 8-bit
      // layout) and then one dot a row, rather than two (the nibbles', the top bits')
      const uint8_t* top = w + kPanel * G / 2;
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      ASERVE_UNROLL for (int64_t k16 = 0; k16 < G / 16; ++k16) {
        ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
          const __m512i n0 = _mm512_loadu_si512(w + (2 * k16 * kVecs + v) * 64);
          const __m512i n1 = _mm512_loadu_si512(w + ((2 * k16 + 1) * kVecs + v) * 64);
          const __m512i t = _mm512_loadu_si512(top + (k16 * kVecs + v) * 64);
          const __m512i q[4] = {
              _mm512_or_si512(_mm512_and_si512(n0, low4),
                              _mm512_and_si512(_mm512_slli_epi16(t, 4), bits45)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n0, 4), low4),
                              _mm512_and_si512(_mm512_slli_epi16(t, 2), bits45)),
              _mm512_or_si512(_mm512_and_si512(n1, low4), _mm512_and_si512(t, bits45)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n1, 4), low4),
                              _mm512_and_si512(_mm512_srli_epi16(t, 2), bits45))};
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
    } else if (R <= 2) {  // (4 or 6 bits: the low nibbles)
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
    if (Bits == 6 && R <= 2) {
      // q = nibble + 16 h: each h moved to bits 4-5 of its byte (16 h, unsigned), so its
      // products add into the nibbles' sums as they are; one 16-bit shift and an AND a part
      const uint8_t* top = w + kPanel * G / 2;
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      ASERVE_UNROLL for (int64_t k16 = 0; k16 < G / 16; ++k16) {
        ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
          const __m512i raw = _mm512_loadu_si512(top + (k16 * kVecs + v) * 64);
          const __m512i part[4] = {
              _mm512_and_si512(_mm512_slli_epi16(raw, 4), bits45),
              _mm512_and_si512(_mm512_slli_epi16(raw, 2), bits45),
              _mm512_and_si512(raw, bits45),
              _mm512_and_si512(_mm512_srli_epi16(raw, 2), bits45)};
          ASERVE_UNROLL for (int r = 0; r < R; ++r) {
            const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + 16 * k16);
            ASERVE_UNROLL for (int sub = 0; sub < 4; ++sub)
              dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], part[sub], _mm512_set1_epi32(xr[sub]));
          }
        }
      }
    }
    const __m256i* meta = reinterpret_cast<const __m256i*>(w + kPanel * G * Bits / 8);
    __m512 s[kVecs], m[kVecs];
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
      s[v] = _mm512_cvtph_ps(_mm256_loadu_si256(meta + v));
      m[v] = zero > 0.f ? _mm512_mul_ps(s[v], _mm512_set1_ps(-zero))
                        : _mm512_cvtph_ps(_mm256_loadu_si256(meta + kVecs + v));
    }
    ASERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(xs[r * groups + g]);
      const __m512 b = _mm512_set1_ps(xsum[r * groups + g]);
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][v]), a);
        acc[r][v] = _mm512_fmadd_ps(m[v], b, _mm512_fmadd_ps(t, s[v], acc[r][v]));
      }
    }
  }
  store_tile<R, E>(acc, c, ldc, cols, ep);
}

using QTile = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t,
                       const uint8_t*, int64_t, int64_t, float, void*, int64_t, int64_t,
                       const TileEpilogue&);
#define ASERVE_QTILES(B, E, G) \
  {nullptr, qtile<1, B, E, G>, qtile<2, B, E, G>, qtile<3, B, E, G>, qtile<4, B, E, G>}
#define ASERVE_QTILES_G(B, G)                                                     \
  {ASERVE_QTILES(B, kPlain, G), ASERVE_QTILES(B, kGatedSplit, G),                 \
   ASERVE_QTILES(B, kGatedSilu, G), ASERVE_QTILES(B, kPlainFloat, G)}
// [group: any, 16, 32][bits: 4, 6, 8][epilogue: gemm.h's first four][rows]: the groups of
// GGUF's types have their loops unrolled; GPTQ / AWQ's larger ones run the general tiles
static const QTile kQTiles[3][3][4][kQRows + 1] = {
    {ASERVE_QTILES_G(4, 0), ASERVE_QTILES_G(6, 0), ASERVE_QTILES_G(8, 0)},
    {ASERVE_QTILES_G(4, 16), ASERVE_QTILES_G(6, 16), ASERVE_QTILES_G(8, 16)},
    {ASERVE_QTILES_G(4, 32), ASERVE_QTILES_G(6, 32), ASERVE_QTILES_G(8, 32)}};
#undef ASERVE_QTILES_G
#undef ASERVE_QTILES

// The tiles (by rows, 1..kQRows) of a layout and an epilogue.
static inline const QTile* qtiles(const QuantLayout& L, int epilogue) {
  return kQTiles[L.group == 16 ? 1 : L.group == 32 ? 2 : 0][(L.bits - 4) / 2][epilogue];
}

#endif

// gemm_linear's contract for a packed quantized weight: y = x [M, K] @ W^T, epilogue 0 (plain,
// + bias), 3 (float32 of the bf16 values), or for a gated pack 1 ([gate | up]) or 2 (SiLU).
torch::Tensor qgemm_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                           c10::optional<torch::Tensor> bias, int64_t epilogue) {
  TORCH_CHECK(qgemm_supported(), "cpu_qgemm.linear: built without AVX512-VNNI and BF16");
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
  const QTile* tiles = qtiles(L, epilogue);
  const int64_t panel_bytes = L.groups * L.group_bytes;
  for_each_panel_task(
      call, packed.size(0), bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
      [&](int64_t p, int64_t m0, int64_t rows, int64_t cols, const TileEpilogue& ep) {
        for (int64_t m = m0; m < m0 + rows; m += kQRows)
          tiles[std::min(kQRows, m0 + rows - m)](
              a + m * K, K, scales + m * L.groups, sums + m * L.groups, L.groups,
              w + p * panel_bytes, L.group, L.group_bytes, L.zero,
              c + (m * ldc + p * call.width) * item, ldc, cols, ep);
      });
  if (words > (int64_t{1} << 22)) std::vector<int64_t>().swap(scratch);  // a long prompt's
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
