// A pre-norm decoder layer (attention, then a gated-SiLU MLP: the Llama family's) in ONE call on
// the CPU bf16 path (the C++ of aserve/kernels/cpu_decoder_layer.py): the kernels the layer's
// modules would call one by one from Python, called in the same order on the same tensors, so
// the result is bit-identical and only the glue between them goes.
//
//   residual += hidden; x = norm(residual)      (first layer: residual = hidden; x = norm(hidden))
//   qkv = x Wqkv^T (+ b); RoPE on q and k in place; K/V stored; attn = attention(q) over the cache
//   o = attn Wo^T (+ b); residual += o; x = norm(residual)
//   out = (silu(x Wgate^T) * (x Wup^T)) Wdown^T (+ b)              -> [out, residual]
//
// The list arguments are in the orders of cpu_decoder_layer.py's WEIGHTS, PLAN and SIZES; an
// absent bias is an empty tensor.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "attention_rows.h"
#include "elementwise.h"
#include "gemm.h"
#include "qgemm.h"

static inline c10::optional<torch::Tensor> bias_of(const torch::Tensor& t) {
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// A GEMM's input in its packed columns' order: x[:, perm] for an act-order (GPTQ) weight, as
// cpu_qgemm.QuantPackedWeight gathers it; x as it is where perm is empty.
static inline torch::Tensor in_columns(const torch::Tensor& x, const torch::Tensor& perm) {
  return perm.numel() > 0 ? x.index_select(1, perm) : x;
}

// See cpu_decoder_layer.py: the ops of one decoder layer, in order, with no Python between them.
std::vector<torch::Tensor> decoder_layer(torch::Tensor hidden, torch::Tensor residual,
                                         torch::Tensor positions, std::vector<torch::Tensor> w,
                                         std::vector<torch::Tensor> plan,
                                         std::vector<int64_t> n, double eps, double scale,
                                         double soft_cap) {
  enum { kInNorm, kPostNorm, kQkv, kQkvBias, kO, kOBias, kGateUp, kDown, kDownBias, kCos, kSin,
         kKCache, kVCache, kQkvPerm, kOPerm, kGateUpPerm, kDownPerm, kWeights };
  enum { kQkvOut, kOOut, kGateUpOut, kDownOut, kHeads, kKvHeads, kHeadDim, kRotary, kWindow,
         kRows, kSizes };
  TORCH_CHECK(w.size() == kWeights && plan.size() == 3 && n.size() == kSizes,
              "decoder_layer: weights, plan and sizes as cpu_decoder_layer.py lists them");
  torch::Tensor x;
  if (residual.numel() == 0) {  // first layer: the residual stream starts as the embeddings
    residual = hidden;
    x = hidden.clone();
    rms_norm(x, c10::nullopt, w[kInNorm], eps);
  } else {
    x = hidden;
    rms_norm(x, residual, w[kInNorm], eps);
  }
  const int64_t T = x.size(0), hq = n[kHeads], hkv = n[kKvHeads], d = n[kHeadDim];
  torch::Tensor qkv =
      packed_linear(in_columns(x, w[kQkvPerm]), w[kQkv], n[kQkvOut], bias_of(w[kQkvBias]), kPlain);
  rope(positions, qkv.narrow(1, 0, (hq + hkv) * d), w[kCos], w[kSin], d, n[kRotary]);
  store_kv(qkv.narrow(1, hq * d, hkv * d).view({T, hkv, d}),
           qkv.narrow(1, (hq + hkv) * d, hkv * d).view({T, hkv, d}), w[kKCache], w[kVCache],
           plan[2]);
  torch::Tensor attn = torch::empty({T, hq, d}, x.options());
  if (n[kRows] < T) attn.narrow(0, n[kRows], T - n[kRows]).zero_();  // padding rows
  if (plan[1].size(0) > 0)
    attend_rows(qkv.narrow(1, 0, hq * d).view({T, hq, d}), w[kKCache], w[kVCache], plan[0],
                plan[1], attn, scale, n[kWindow], soft_cap, c10::nullopt);  // no sinks here
  torch::Tensor o = packed_linear(in_columns(attn.view({T, hq * d}), w[kOPerm]), w[kO],
                                  n[kOOut], bias_of(w[kOBias]), kPlain);
  rms_norm(o, residual, w[kPostNorm], eps);
  torch::Tensor act = packed_linear(in_columns(o, w[kGateUpPerm]), w[kGateUp], n[kGateUpOut],
                                    c10::nullopt, kGatedSilu);
  return {packed_linear(in_columns(act, w[kDownPerm]), w[kDown], n[kDownOut],
                        bias_of(w[kDownBias]), kPlain),
          residual};
}

// A run of decoder layers (a model's, or a pipeline stage's share) bound once, so that a step
// runs them all in one call: decoder_layer for each, in order, on one step's plan (the layers
// share a KV cache group). Per layer: its weights and sizes (the lists above without `rows`),
// eps, scale and soft_cap. Saves the Python and argument conversion between layers (7-20 us a
// layer, measured).
class DecoderStack {
 public:
  DecoderStack(std::vector<std::vector<torch::Tensor>> w, std::vector<std::vector<int64_t>> n,
               std::vector<double> eps, std::vector<double> scale, std::vector<double> soft_cap)
      : w_(std::move(w)), n_(std::move(n)), eps_(std::move(eps)), scale_(std::move(scale)),
        soft_cap_(std::move(soft_cap)) {
    const size_t layers = w_.size();
    TORCH_CHECK(layers > 0 && n_.size() == layers && eps_.size() == layers &&
                    scale_.size() == layers && soft_cap_.size() == layers,
                "DecoderStack: one weights list, sizes list, eps, scale and soft_cap a layer");
  }

  // (hidden, residual) after every layer; residual empty: hidden is the embeddings.
  std::vector<torch::Tensor> forward(torch::Tensor hidden, torch::Tensor residual,
                                     torch::Tensor positions, std::vector<torch::Tensor> plan,
                                     int64_t rows) const {
    for (size_t i = 0; i < w_.size(); ++i) {
      std::vector<int64_t> sizes = n_[i];
      sizes.push_back(rows);
      auto out = decoder_layer(hidden, residual, positions, w_[i], plan, std::move(sizes),
                               eps_[i], scale_[i], soft_cap_[i]);
      hidden = std::move(out[0]);
      residual = std::move(out[1]);
    }
    return {hidden, residual};
  }

 private:
  std::vector<std::vector<torch::Tensor>> w_;
  std::vector<std::vector<int64_t>> n_;
  std::vector<double> eps_, scale_, soft_cap_;
};
