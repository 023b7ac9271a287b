// A mixture-of-experts layer's experts in ONE call on the CPU bf16 path (the C++ of
// aserve/kernels/cpu_moe.py), over experts packed once with gemm.h's panels (w13 gated, w2
// plain):
//
//   route     the T * k (token, slot) pairs by local expert (a counting sort), in (expert,
//             slot, token) order: the rows of expert e are [start[e], start[e + 1])
//   gather    xs[row] = x[token of row]                                           [rows, H]
//   up        h = act(xs W13[e]^T + b13[e]), gated panels, the activation in the
//             epilogue                                                            [rows, I]
//   down      y = h W2[e]^T + b2[e]                                               [rows, H]
//   combine   out[t] = bf16(sum of float(y[row]) * w[t, j] over t's local slots)   [T, H]
//
// `up` and `down` each split into (expert, panel, 64-row block) tasks shared out among the
// threads by cost (rows, plus the panel's streaming), so a decode step (a row or two per
// expert) still keeps every core on its own panels while experts with more rows count more.
// Each step rounds where `fused_moe_ref`'s torch ops do, and `combine` adds a token's slots in
// the reference's order (by local expert, then slot; the product first, then the sum, from
// zero), so the result is bit-equal to the dense loop of gemm_linear, the element-wise
// activation and index_add_.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gemm.h"

constexpr int64_t kMaxTopK = 64;

// The pairs of one call grouped by local expert. `row[t * k + j]`: the pair's row, or -1 where
// its expert is another rank's.
struct MoeRoute {
  std::vector<int64_t> start;  // [E + 1]
  std::vector<int64_t> token;  // [rows]: the token of each row
  std::vector<int64_t> row;    // [T * k]
};

// ids [T, k] global expert ids; map [num_global] -> local index or -1 (nullptr: identity).
static MoeRoute moe_route(const int64_t* ids, int64_t T, int64_t k, const int32_t* map,
                          int64_t num_global, int64_t E) {
  MoeRoute r{std::vector<int64_t>(E + 1, 0), {}, std::vector<int64_t>(T * k, -1)};
  std::vector<int64_t> local(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_global, "fused_moe: expert id ", ids[i],
                " outside [0, ", num_global, ")");
    local[i] = map == nullptr ? ids[i] : map[ids[i]];
    TORCH_CHECK(local[i] >= -1 && local[i] < E, "fused_moe: local expert ", local[i],
                " outside [-1, ", E, ")");
    if (local[i] >= 0) ++r.start[local[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  r.token.resize(r.start[E]);
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < T; ++t)
      if (const int64_t e = local[t * k + j]; e >= 0) {
        r.row[t * k + j] = next[e];
        r.token[next[e]++] = t;
      }
  return r;
}

// What every MoE call checks of its routing inputs (errors prefixed by `name`): x a contiguous
// bf16 [T, H], topk_weights float32 and topk_ids int64, both [T, k] with k <= kMaxTopK,
// expert_map (global id -> local index or -1) contiguous int32 or absent.
static void check_moe_inputs(const char* name, const torch::Tensor& x,
                             const torch::Tensor& topk_weights, const torch::Tensor& topk_ids,
                             const c10::optional<torch::Tensor>& expert_map) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be a contiguous bf16 [T, H]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous() && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_ids.size(0) == x.size(0) && topk_ids.size(1) <= kMaxTopK,
              name, ": topk_weights float32 and topk_ids int64, both [T, k], k <= 64");
  TORCH_CHECK(!expert_map.has_value() ||
                  (expert_map->scalar_type() == at::kInt && expert_map->is_contiguous()),
              name, ": expert_map is contiguous int32");
}

// moe_route over checked inputs (check_moe_inputs) and E local experts.
static MoeRoute route_of(const torch::Tensor& topk_ids,
                         const c10::optional<torch::Tensor>& expert_map, int64_t E) {
  return moe_route(topk_ids.data_ptr<int64_t>(), topk_ids.size(0), topk_ids.size(1),
                   expert_map.has_value() ? expert_map->data_ptr<int32_t>() : nullptr,
                   expert_map.has_value() ? expert_map->numel() : E, E);
}

// One panel of one expert over up to kRowBlock of its rows.
struct MoeTask {
  int64_t e, p, m0, rows;
};

// Panel-major within each expert, as gemm_linear orders its tasks.
static std::vector<MoeTask> moe_tasks(const MoeRoute& r, int64_t panels) {
  std::vector<MoeTask> tasks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(r.start.size()); ++e)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t m0 = r.start[e]; m0 < r.start[e + 1]; m0 += kRowBlock)
        tasks.push_back({e, p, m0, std::min(kRowBlock, r.start[e + 1] - m0)});
  return tasks;
}

// fn(task) for every task, the tasks split into one contiguous run per thread of about equal
// cost: a task's rows, plus kPanelCost for streaming its panel (a decode step's tasks cost the
// same, so each thread takes as many; a prefill's experts differ in rows). Contiguous runs keep
// a thread on consecutive panels, as gemm_linear's split does.
constexpr int64_t kPanelCost = 8;

template <typename F>
static void for_each_task(const std::vector<MoeTask>& tasks, const F& fn) {
  const int64_t n = tasks.size();
  std::vector<int64_t> before(n + 1, 0);  // the cost of tasks [0, i)
  for (int64_t i = 0; i < n; ++i) before[i + 1] = before[i] + tasks[i].rows + kPanelCost;
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {  // the tasks starting in this thread's share
      const auto first = std::lower_bound(before.begin(), before.end() - 1,
                                          before[n] * th / threads);
      const auto last = std::lower_bound(before.begin(), before.end() - 1,
                                         before[n] * (th + 1) / threads);
      for (auto i = first; i < last; ++i) fn(tasks[i - before.begin()]);
      panel_rows_done();
    }
  });
}

#ifdef ASERVE_GEMM
// out[t] = bf16(sum over t's local slots j, by row (= by expert, then slot), of
// float(y[row]) * w[t, j]), the product rounded to float before the sum (no FMA), from zero.
static void moe_combine(const MoeRoute& r, const at::BFloat16* y, const float* w, int64_t T,
                        int64_t k, int64_t H, at::BFloat16* out) {
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t rows[kMaxTopK];
      float weights[kMaxTopK];
      int64_t n = 0;
      for (int64_t j = 0; j < k; ++j) {  // insertion by row
        const int64_t row = r.row[t * k + j];
        if (row < 0) continue;
        int64_t i = n++;
        for (; i > 0 && rows[i - 1] > row; --i) rows[i] = rows[i - 1], weights[i] = weights[i - 1];
        rows[i] = row, weights[i] = w[t * k + j];
      }
      for (int64_t c = 0; c < H; c += 16) {
        const __mmask16 m = tail_mask(H - c);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {  // mul_round: never contracted into an FMA
          const __m512 p = _mm512_mul_round_ps(load_bf16(y + rows[i] * H + c, m),
                                               _mm512_set1_ps(weights[i]),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          acc = _mm512_add_ps(acc, p);
        }
        store_bf16(out + t * H + c, acc, m);
      }
    }
  });
}
#endif

// x [T, H] bf16; w13 [E, panels, H / 2, 3, 16, 2] (gemm_pack gated, per expert), w2 [E, panels,
// I / 2, 3, 16, 2] (plain); biases [E, 2I] / [E, H] bf16 or absent; topk_weights [T, k] float32,
// topk_ids [T, k] int64 global ids, expert_map [num_global] int32 or absent; activation "silu",
// "gelu_tanh" or "swiglu_oai" (alpha, limit; limit infinite: none) -> [T, H] bf16.
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor w13, torch::Tensor w2,
                        c10::optional<torch::Tensor> w13_bias,
                        c10::optional<torch::Tensor> w2_bias, torch::Tensor topk_weights,
                        torch::Tensor topk_ids, c10::optional<torch::Tensor> expert_map,
                        int64_t I, const std::string& activation, double alpha, double limit) {
  TORCH_CHECK(gemm_supported(), "fused_moe: built without AVX512-BF16");
  check_moe_inputs("fused_moe", x, topk_weights, topk_ids, expert_map);
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), k = topk_ids.size(1);
  TORCH_CHECK(w13.dim() == 6 && w2.dim() == 6 && w2.size(0) == E && w13.size(2) * 2 == H &&
                  w2.size(2) * 2 == I && w13.size(1) * kHalf >= I && w2.size(1) * kPanel >= H &&
                  w13.is_contiguous() && w2.is_contiguous() && H % 2 == 0 && I % 2 == 0,
              "fused_moe: packed weights of H = ", H, ", I = ", I);
  for (const auto& [b, n] : {std::make_pair(w13_bias, 2 * I), std::make_pair(w2_bias, H)})
    TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kBFloat16 && b->is_contiguous() &&
                                   b->numel() == E * n),
                "fused_moe: biases are contiguous bf16 [E, 2I] and [E, H]");
  const int epilogue = activation == "silu"        ? kGatedSilu
                       : activation == "gelu_tanh" ? kGatedGelu
                       : activation == "swiglu_oai" ? kGatedSwiglu
                                                    : -1;
  TORCH_CHECK(epilogue >= 0, "fused_moe: unknown activation ", activation);
  const MoeRoute r = route_of(topk_ids, expert_map, E);
  const int64_t rows = r.start[E];
  if (rows == 0) return torch::zeros({T, H}, x.options());
  auto out = torch::empty({T, H}, x.options());
#ifdef ASERVE_GEMM
  using bf16 = at::BFloat16;
  auto xs = torch::empty({rows, H}, x.options()), h = torch::empty({rows, I}, x.options());
  auto y = torch::empty({rows, H}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16 *xsp = xs.data_ptr<bf16>(), *hp = h.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::copy_n(xp + r.token[i] * H, H, xsp + i * H);
  });

  const bf16* w13p = w13.data_ptr<bf16>();
  const bf16* b13 = w13_bias.has_value() ? w13_bias->data_ptr<bf16>() : nullptr;
  const int64_t panels13 = w13.size(1), panel13 = H / 2 * kPanel * 2;  // bf16 per panel
  const std::vector<MoeTask> up = moe_tasks(r, panels13);
  const bool amx13 = use_amx(H), amx2 = use_amx(I);
  TileEpilogue gated;
  gated.d = I, gated.swiglu = SwigluOaiMul(alpha, limit);
  for_each_task(up, [&](const MoeTask& t) {
    TileEpilogue ep = gated;
    ep.bias = b13 == nullptr ? nullptr : b13 + t.e * 2 * I + t.p * kHalf;
    panel_rows(epilogue, amx13, xsp + t.m0 * H, t.rows, H, w13p + (t.e * panels13 + t.p) * panel13,
               reinterpret_cast<char*>(hp + t.m0 * I + t.p * kHalf), I, sizeof(bf16),
               std::min(kHalf, I - t.p * kHalf), ep);
  });

  const bf16* w2p = w2.data_ptr<bf16>();
  const bf16* b2 = w2_bias.has_value() ? w2_bias->data_ptr<bf16>() : nullptr;
  const int64_t panels2 = w2.size(1), panel2 = I / 2 * kPanel * 2;
  const std::vector<MoeTask> down = moe_tasks(r, panels2);
  for_each_task(down, [&](const MoeTask& t) {
    TileEpilogue ep;
    ep.bias = b2 == nullptr ? nullptr : b2 + t.e * H + t.p * kPanel;
    panel_rows(kPlain, amx2, hp + t.m0 * I, t.rows, I, w2p + (t.e * panels2 + t.p) * panel2,
               reinterpret_cast<char*>(yp + t.m0 * H + t.p * kPanel), H, sizeof(bf16),
               std::min(kPanel, H - t.p * kPanel), ep);
  });

  moe_combine(r, yp, topk_weights.data_ptr<float>(), T, k, H, out.data_ptr<bf16>());
#endif
  return out;
}
