// A mixture-of-experts layer's experts kept as integers, in ONE call (the C++ of
// aserve/kernels/cpu_qgemm.py's QuantFusedMoE): moe.h's steps with qgemm.h's tiles, over each
// expert's weights packed by qgemm_pack and stacked (w13 gated, w2 plain):
//
//   route      moe_route: the T * k (token, slot) pairs by local expert
//   quantize   x's rows to int8 per group of w13's G (quantize_rows), once a token, then
//              gathered to the pairs' rows (a token's k rows are the same row quantized once)
//   up         h = silu(gate) * up of the gated tiles                               [rows, I]
//   quantize   h's rows per group of w2's G
//   down       y = h W2[e]^T                                                        [rows, H]
//   combine    moe_combine: out[t] = bf16(sum of float(y[row]) * w[t, j]), by row
//
// `up` and `down` are moe.h's (expert, panel, 64-row block) tasks shared out by cost. Rows are
// quantized per row, so each expert's GEMM sees what a call of qgemm_linear over its rows would,
// and the sums run in `QuantFusedMoE`'s loop order: the result is bit-equal to that loop.
// SiLU-gated experts without biases only (the loop serves the rest).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "moe.h"
#include "qgemm.h"

#ifdef ASERVE_QGEMM
// Rows quantized as qgemm_linear quantizes them: q int8 [rows, K], scales and sums float
// [rows, groups of the weight's layout].
struct QuantRows {
  const int8_t* q;
  const float *scales, *sums;
  int64_t K;
};

// out [rows, ldc] bf16 = each expert's rows of `a` @ its packed weight (w: [E, panels, L's
// blocks x block bytes]), over moe.h's (expert, panel, row block) tasks; `width` outputs a
// panel (kHalf gated, kPanel plain), `ldc` outputs in all; epilogue kGatedSilu or kPlain.
static void qmoe_gemm(const MoeRoute& r, const QuantRows& a, const uint8_t* w, int64_t panels,
                      const QuantLayout& L, int epilogue, int64_t width, at::BFloat16* out,
                      int64_t ldc) {
  const int64_t panel_bytes = L.blocks * L.block_bytes;
  const uint64_t id = next_qgemm_call();
  for_each_task(moe_tasks(r, panels), [&](const MoeTask& t) {
    TileEpilogue ep;
    ep.d = epilogue == kGatedSilu ? ldc : 0;
    const int64_t cols = std::min(width, ldc - t.p * width);
    qpanel_rows(L, epilogue, w + (t.e * panels + t.p) * panel_bytes, id, a.q + t.m0 * a.K, a.K,
                a.scales + t.m0 * L.groups, a.sums + t.m0 * L.groups, t.rows,
                reinterpret_cast<char*>(out + t.m0 * ldc + t.p * width), ldc,
                sizeof(at::BFloat16), cols, ep);
  });
}
#endif

// x [T, H] bf16; w13 uint8 [E, panels, blocks, block bytes] (qgemm_pack gated, per expert),
// w2 uint8 [E, panels, blocks, block bytes] (plain); topk_weights [T, k] float32, topk_ids
// [T, k] int64 global ids, expert_map [num_global] int32 or absent -> [T, H] bf16.
torch::Tensor qfused_moe(torch::Tensor x, torch::Tensor w13, torch::Tensor w2,
                         torch::Tensor topk_weights, torch::Tensor topk_ids,
                         c10::optional<torch::Tensor> expert_map, int64_t I) {
  TORCH_CHECK(qgemm_supported(), "qfused_moe: built without AVX512-VNNI and BF16");
  check_moe_inputs("qfused_moe", x, topk_weights, topk_ids, expert_map);
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1);
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(0) > 0 && w2.size(0) == w13.size(0) &&
                  w13.scalar_type() == at::kByte && w2.scalar_type() == at::kByte &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "qfused_moe: stacked packed weights, uint8 [E, panels, blocks, block bytes]");
  const int64_t E = w13.size(0), panels13 = w13.size(1), panels2 = w2.size(1);
  TORCH_CHECK(I > 0 && panels13 * kHalf >= I && (panels13 - 1) * kHalf < I &&
                  panels2 * kPanel >= H && (panels2 - 1) * kPanel < H,
              "qfused_moe: packed weights of H = ", H, ", I = ", I);
  const QuantLayout L13 = quant_layout(w13[0], H), L2 = quant_layout(w2[0], I);
  const MoeRoute r = route_of(topk_ids, expert_map, E);
  const int64_t rows = r.start[E];
  if (rows == 0) return torch::zeros({T, H}, x.options());
  auto out = torch::empty({T, H}, x.options());
#ifdef ASERVE_QGEMM
  const auto bytes = x.options().dtype(at::kChar), floats = x.options().dtype(at::kFloat);
  // x quantized once a token, then its rows gathered to the pairs'
  const int64_t g13 = L13.groups, g2 = L2.groups;
  auto xq = torch::empty({T, H}, bytes), xsc = torch::empty({2, T, g13}, floats);
  quantize_rows(x.data_ptr<at::BFloat16>(), T, H, L13.group, xq.data_ptr<int8_t>(),
                xsc.data_ptr<float>(), xsc.data_ptr<float>() + T * g13);
  auto aq = torch::empty({rows, H}, bytes), asc = torch::empty({2, rows, g13}, floats);
  {
    const int8_t* src = xq.data_ptr<int8_t>();
    const float* scales = xsc.data_ptr<float>();
    int8_t* dst = aq.data_ptr<int8_t>();
    float* dscales = asc.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = r.token[i];
        std::copy_n(src + t * H, H, dst + i * H);
        for (int64_t s = 0; s < 2; ++s)  // scales, then sums
          std::copy_n(scales + (s * T + t) * g13, g13, dscales + (s * rows + i) * g13);
      }
    });
  }
  auto h = torch::empty({rows, I}, x.options());
  const float* as = asc.data_ptr<float>();
  qmoe_gemm(r, {aq.data_ptr<int8_t>(), as, as + rows * g13, H}, w13.data_ptr<uint8_t>(),
            panels13, L13, kGatedSilu, kHalf, h.data_ptr<at::BFloat16>(), I);

  auto hq = torch::empty({rows, I}, bytes), hsc = torch::empty({2, rows, g2}, floats);
  quantize_rows(h.data_ptr<at::BFloat16>(), rows, I, L2.group, hq.data_ptr<int8_t>(),
                hsc.data_ptr<float>(), hsc.data_ptr<float>() + rows * g2);
  auto y = torch::empty({rows, H}, x.options());
  const float* hs = hsc.data_ptr<float>();
  qmoe_gemm(r, {hq.data_ptr<int8_t>(), hs, hs + rows * g2, I}, w2.data_ptr<uint8_t>(),
            panels2, L2, kPlain, kPanel, y.data_ptr<at::BFloat16>(), H);

  moe_combine(r, y.data_ptr<at::BFloat16>(), topk_weights.data_ptr<float>(), T, k, H,
              out.data_ptr<at::BFloat16>());
#endif
  return out;
}
