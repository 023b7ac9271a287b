// Attention sinks (gpt-oss) as the CPU attention kernels take them: one float32 logit per query
// head that joins every row's softmax (its max and its sum) but carries no value,
//
//   p_j = exp(s_j - m) / (exp(sink_h - m) + sum_i exp(s_i - m)),   m = max(sink_h, max_i s_i)
//
// passed from Python as an optional [num_heads] tensor (None: no sinks, and no work for them).
#pragma once

#include <torch/extension.h>

#include <cstdint>

// The sinks' data, or nullptr for None; a tensor must be contiguous float32 [num_heads].
static inline const float* sinks_data(const c10::optional<torch::Tensor>& sinks,
                                      int64_t num_heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
              sinks->size(0) == num_heads && sinks->is_contiguous() && sinks->device().is_cpu(),
              "sinks: a contiguous float32 CPU tensor of ", num_heads, " values (one per query "
              "head) needed");
  return sinks->data_ptr<float>();
}
