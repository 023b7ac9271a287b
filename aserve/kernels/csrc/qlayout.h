// The packed layout of qgemm.h's integer weights: W[n, k] = scale[n, g] * q[n, k] + min[n, g]
// per group g = k / G of G inputs (0 <= q < 2^bits), repacked once at load into the bf16 GEMM's
// panels of 48 outputs (gemm.h's panel_lane, so a gated [gate; up] pairs its halves the same
// way). A panel is a run of blocks read front to back; a block's values, per group of G inputs:
//
//   8 bits: data[kq, v, j, t]  = q[48 p + 16 v + j, G g + 4 kq + t]                  (48 G bytes)
//   4 bits: data[k8, v, j, t]  = q[.., G g + 8 k8 + t] | q[.., G g + 8 k8 + 4 + t] << 4 (24 G)
//   6 bits: 4 bits' layout of the low nibbles (24 G), then the top two bits of 16 inputs a
//           byte run: high[k16, v, j, t] = sum_s (q[.., G g + 16 k16 + 4 s + t] >> 4) << 2 s
//           (12 G; Q6_K, and 5-bit values in other groups, in 6/8 of int8's bytes)
//   5 bits: (groups of 32: Q5_0, Q5_1, Q5_K) the nibbles so, then the fifth bits of 32 inputs
//           a byte: high[k32, v, j, t] = sum_s (q[.., G g + 32 k32 + 4 s + t] >> 4) << s (6 G)
//
// and then its scales, in one of two forms:
//
//   one level (a block is one group): 48 fp16 scales, 48 fp16 mins          (192 bytes a group)
//   two levels (a block is a super-block of 256 inputs, 256 / G groups, as GGUF's K-quants
//     store them), ahead of the values, so that a block is read front to back: the block's 48
//     fp16 scales and 48 fp16 mins, then per group 48 int8 sub-scales, then per group 48 int8
//     sub-mins (padded to whole cache lines); scale = block scale * sub-scale, min = block
//     min * sub-min (exact in float32: 11 by 8 bits). Q4_K: 4.625 bits a weight against one
//     level's 5 (its own 4.5 packs the 6-bit sub-scales tighter); Q6_K 6.56 against 7.
//
// Symmetric weights (every min -2^(bits-1) scale: Q8_0, Q4_0, Q6_K, GPTQ without zero points)
// leave out every min (of both levels); the kernel makes it from the scale.
//
// A packed weight is uint8 [panels, blocks, block bytes] over K inputs: K / blocks and the block's
// bytes say G, the bits, the levels and whether mins are stored (no two layouts of one K and
// blocks have one size; quant_layout checks), so the tensor describes itself.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>

#include "gemm.h"

constexpr int64_t kQuantScales = kPanel * 2;  // bytes of a block's 48 fp16 scales (or mins)
constexpr int64_t kSuperBlock = 256;          // inputs of a two-level block

struct QuantLayout {
  int64_t group, bits, groups;  // G, the value bits, K / G (the activations' groups too)
  int64_t sub;                  // groups a block: 1 (one level) or 256 / G (two levels)
  int64_t value_bytes;          // a group's values: 48 G bits / 8
  int64_t block_bytes, blocks;  // a block's bytes, blocks a panel
  float zero;  // symmetric: the min is -zero * scale (2^(bits-1)); 0: mins are stored
};

// A block's bytes: `sub` groups of G inputs (1: one level).
// Two levels' tables ahead of a block's values, padded to whole cache lines (Q6_K's 864 bytes
// to 896), so that the values' 64-byte loads each read one line.
static inline int64_t quant_head_bytes(bool symmetric, int64_t sub) {
  const int64_t bytes = sub > 1 ? (symmetric ? 1 : 2) * (kQuantScales + sub * kPanel) : 0;
  return (bytes + 63) / 64 * 64;
}

static inline int64_t quant_block_bytes(int64_t G, int64_t bits, bool symmetric, int64_t sub) {
  const int64_t tables = symmetric ? 1 : 2;  // scales (and mins)
  return sub > 1 ? quant_head_bytes(symmetric, sub) + sub * kPanel * G * bits / 8
                 : kPanel * G * bits / 8 + kQuantScales * tables;
}

// The layout of a packed weight [panels, blocks, block bytes] over K inputs.
static QuantLayout quant_layout(const torch::Tensor& packed, int64_t K) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "qgemm: a packed weight is a contiguous uint8 [panels, blocks, block bytes]");
  const int64_t blocks = packed.size(1), bb = packed.size(2);
  TORCH_CHECK(blocks > 0 && K % blocks == 0, "qgemm: ", K, " inputs in ", blocks, " blocks");
  const int64_t span = K / blocks;  // a block's inputs
  QuantLayout found{};
  int matches = 0;
  for (const int64_t bits : {4, 5, 6, 8})
    for (const bool sym : {false, true}) {
      // one level: a block is a group of `span` inputs (5 bits: of 32 alone)
      if (span % 16 == 0 && (bits != 5 || span == 32) &&
          bb == quant_block_bytes(span, bits, sym, 1))
        found = {span, bits, blocks, 1, kPanel * span * bits / 8, bb, blocks,
                 sym ? static_cast<float>(int64_t{1} << (bits - 1)) : 0.f},
        ++matches;
      if (span != kSuperBlock) continue;
      for (const int64_t G : {16, 32})
        if ((bits != 5 || G == 32) && bb == quant_block_bytes(G, bits, sym, kSuperBlock / G))
          found = {G, bits, K / G, kSuperBlock / G, kPanel * G * bits / 8, bb, blocks,
                   sym ? static_cast<float>(int64_t{1} << (bits - 1)) : 0.f},
          ++matches;
    }
  TORCH_CHECK(matches == 1, "qgemm: block bytes ", bb, " fit ", matches, " layouts of ", span,
              " inputs a block");
  return found;
}

// q [N, K] uint8 (values < 2^bits) -> uint8 [panels, blocks, block bytes]. One level: scale /
// mins fp16 [N, K / G]. Two levels (block_scale given): scale / mins int8 [N, K / G] sub-scales
// and sub-mins, block_scale / block_mins fp16 [N, K / 256]. No mins: symmetric, the min of
// every group -2^(bits-1) scale (the caller has checked that it is). `gated`: q is [gate; up],
// packed as panel_lane pairs them.
torch::Tensor qgemm_pack(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> mins_,
                         int64_t bits, bool gated, c10::optional<torch::Tensor> block_scale_,
                         c10::optional<torch::Tensor> block_mins_) {
  const bool symmetric = !mins_.has_value(), two = block_scale_.has_value();
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "qgemm_pack: q is uint8 [N, K]");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "qgemm_pack: 4, 5, 6 or 8 bits, not ", bits);
  TORCH_CHECK(!two || block_mins_.has_value() != symmetric,
              "qgemm_pack: block mins go with sub-mins");
  const int64_t N = q.size(0), K = q.size(1);
  torch::Tensor mins = symmetric ? scale : *mins_;
  const auto sub_type = two ? at::kChar : at::kHalf;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) > 0 &&
                  scale.sizes() == mins.sizes() && scale.scalar_type() == sub_type &&
                  mins.scalar_type() == sub_type,
              "qgemm_pack: scale and min of [N, K / G], fp16 (int8 with block scales)");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 16 == 0,
              "qgemm_pack: the group size must divide K and be a multiple of 16");
  TORCH_CHECK(bits != 5 || K / groups == 32, "qgemm_pack: 5 bits take groups of 32");
  const int64_t G = K / groups, sub = two ? kSuperBlock / G : 1;
  // the fp16 tables: one level, the groups'; two, the blocks'
  torch::Tensor bscale = two ? block_scale_->contiguous() : scale.contiguous();
  torch::Tensor bmins = !two ? mins.contiguous() : symmetric ? bscale : block_mins_->contiguous();
  if (two)
    TORCH_CHECK((G == 16 || G == 32) && K % kSuperBlock == 0 && bscale.dim() == 2 &&
                    bscale.size(0) == N && bscale.size(1) == K / kSuperBlock &&
                    bscale.sizes() == bmins.sizes() && bscale.scalar_type() == at::kHalf &&
                    bmins.scalar_type() == at::kHalf,
                "qgemm_pack: two levels take groups of 16 or 32 in blocks of 256 inputs, "
                "block scales and mins fp16 [N, K / 256]");
  TORCH_CHECK(!gated || N % 2 == 0, "qgemm_pack: a gated weight has 2 d rows");
  TORCH_CHECK(N == 0 || q.max().item<int64_t>() < (int64_t{1} << bits),
              "qgemm_pack: a value does not fit ", bits, " bits");
  q = q.contiguous(), scale = scale.contiguous(), mins = mins.contiguous();
  const int64_t blocks = groups / sub, vb = kPanel * G * bits / 8;
  const int64_t bb = quant_block_bytes(G, bits, symmetric, sub);
  const int64_t d = N / 2;
  const int64_t panels = gated ? (d + kHalf - 1) / kHalf : (N + kPanel - 1) / kPanel;
  auto out = torch::zeros({panels, blocks, bb}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t tables = symmetric ? 1 : 2, head = quant_head_bytes(symmetric, sub);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t p, lane;  // lane = 16 v + j: each byte below is this row's alone
      panel_lane(n, gated, d, p, lane);
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* block = dst + (p * blocks + g / sub) * bb;
        uint8_t* base = block + head + (g % sub) * vb;
        const uint8_t* row = src + n * K + g * G;
        uint8_t* high = base + kPanel * G / 2;  // 5 or 6 bits: the top bits' run
        for (int64_t k = 0; k < G; ++k) {
          if (bits == 8) {
            base[((k / 4) * kPanel + lane) * 4 + k % 4] = row[k];
            continue;
          }
          base[((k / 8) * kPanel + lane) * 4 + k % 4] |= (row[k] & 0x0F) << (4 * ((k % 8) / 4));
          if (bits == 6)
            high[((k / 16) * kPanel + lane) * 4 + k % 4] |= (row[k] >> 4) << (2 * ((k % 16) / 4));
          if (bits == 5)
            high[((k / 32) * kPanel + lane) * 4 + k % 4] |= (row[k] >> 4) << ((k % 32) / 4);
        }
        if (two) {  // the sub-scales (and sub-mins) of group g % sub
          int8_t* subs = reinterpret_cast<int8_t*>(block + kQuantScales * tables);
          subs[(g % sub) * kPanel + lane] = scale.data_ptr<int8_t>()[n * groups + g];
          if (!symmetric)
            subs[(sub + g % sub) * kPanel + lane] = mins.data_ptr<int8_t>()[n * groups + g];
          if (g % sub != 0) continue;
        }
        // the block's fp16 scales and mins: one level, the group's; two, the block's
        at::Half* meta = reinterpret_cast<at::Half*>(two ? block : base + vb);
        const int64_t i = two ? n * blocks + g / sub : n * groups + g;
        meta[lane] = bscale.data_ptr<at::Half>()[i];
        if (!symmetric) meta[kPanel + lane] = bmins.data_ptr<at::Half>()[i];
      }
    }
  });
  return out;
}

// One group's float32 scale and min of output `lane` (of a panel) from its block's bytes.
static inline void group_scale(const QuantLayout& L, const uint8_t* block, int64_t j,
                               int64_t lane, float& s, float& m) {
  const bool sym = L.zero > 0.f;
  const int64_t tables = sym ? 1 : 2;
  if (L.sub == 1) {
    const at::Half* h = reinterpret_cast<const at::Half*>(block + L.value_bytes);
    s = h[lane];
    m = sym ? -L.zero * s : static_cast<float>(h[kPanel + lane]);
    return;
  }
  const at::Half* h = reinterpret_cast<const at::Half*>(block);
  const int8_t* subs = reinterpret_cast<const int8_t*>(block + kQuantScales * tables);
  s = static_cast<float>(h[lane]) * static_cast<float>(subs[j * kPanel + lane]);
  m = sym ? -L.zero * s
          : static_cast<float>(h[kPanel + lane]) *
                static_cast<float>(subs[(L.sub + j) * kPanel + lane]);
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
        const uint8_t* block = src + (p * L.blocks + g / L.sub) * L.block_bytes;
        const uint8_t* base =
            block + quant_head_bytes(L.zero > 0.f, L.sub) + (g % L.sub) * L.value_bytes;
        float s, m;
        group_scale(L, block, g % L.sub, lane, s, m);
        const uint8_t* high = base + kPanel * G / 2;
        for (int64_t k = 0; k < G; ++k) {
          int q = L.bits == 8 ? base[((k / 4) * kPanel + lane) * 4 + k % 4]
                              : (base[((k / 8) * kPanel + lane) * 4 + k % 4] >>
                                 (4 * ((k % 8) / 4))) & 0x0F;
          if (L.bits == 6)
            q |= ((high[((k / 16) * kPanel + lane) * 4 + k % 4] >> (2 * ((k % 16) / 4))) & 3)
                 << 4;
          if (L.bits == 5)
            q |= ((high[((k / 32) * kPanel + lane) * 4 + k % 4] >> ((k % 32) / 4)) & 1) << 4;
          dst[i * K + g * G + k] = s * static_cast<float>(q) + m;
        }
      }
    }
  });
  return out;
}
