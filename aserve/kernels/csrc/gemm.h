// bf16 GEMM for CPUs with AVX512-BF16: y = x @ W^T (+ b) over a weight packed once at load (the
// C++ of aserve/kernels/cpu_gemm.py).
//
// The weight [N, K] is repacked into panels of 48 output features, k-pairs interleaved the way
// `vdpbf16ps` consumes them (one 64-byte vector = 16 features x 2 consecutive k):
//
//   packed[p, kp, v, j, t] = W[48 p + 16 v + j, 2 kp + t]        (zero past N)
//
// A micro-kernel keeps an 8-row x 48-column tile of float32 sums in 24 registers and walks K two
// at a time: 3 vector loads of the panel, 8 broadcasts of x's k-pairs, 24 `vdpbf16ps` (products
// exact, sums in float32), then adds the bias and rounds to bf16 once. Threads split (panel,
// 64-row block) tasks, panel-major, so a thread reuses a panel from L2 across row blocks.
//
// A gated weight (an MLP's [gate; up]) is packed with 24 gate rows and the same 24 up rows in
// each panel (panel_lane), so a tile holds both halves of 24 outputs and its epilogue applies
// silu(gate) * up (or, for the fused MoE, activation.h's other gated activations, after a
// bias): the activation costs no pass over memory of its own, bit-equal to the GEMM then
// silu_and_mul.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>

#include "activation.h"
#include "simd.h"

#if defined(ASERVE_AVX512) && defined(__AVX512BF16__)
#define ASERVE_GEMM 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ASERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

constexpr int64_t kVecs = 3, kPanel = 16 * kVecs, kHalf = kPanel / 2, kRows = 8,
                  kRowBlock = 64;

bool gemm_supported() {
#ifdef ASERVE_GEMM
  return true;
#else
  return false;
#endif
}

// Panel lane of weight row n. Plain: n = 48 p + lane. Gated ([gate; up], d rows each): panel p
// holds outputs [24 p, 24 p + 24) as vectors (gate 0..15), (up 0..15), (gate 16..23 | up
// 16..23), so that the tile's epilogue pairs gate and up sums without moving them in memory.
static inline void panel_lane(int64_t n, bool gated, int64_t d, int64_t& p, int64_t& lane) {
  if (!gated) {
    p = n / kPanel, lane = n % kPanel;
    return;
  }
  const int64_t half = n / d, c = n % d, o = c % kHalf;
  p = c / kHalf;
  lane = o < 16 ? 16 * half + o : 32 + 8 * half + (o - 16);
}

// w [N, K] bf16 (K even) -> [panels, K / 2, 3, 16, 2], zero where no row lands. `gated`: w is
// [gate; up] (N even), packed as `panel_lane` says.
torch::Tensor gemm_pack(torch::Tensor w, bool gated) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "gemm_pack: a bf16 [N, K] weight with K even");
  TORCH_CHECK(!gated || w.size(0) % 2 == 0, "gemm_pack: a gated weight has 2 d rows");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, d = N / 2;
  const int64_t panels = gated ? (d + kHalf - 1) / kHalf : (N + kPanel - 1) / kPanel;
  auto out = torch::zeros({panels, K2, kVecs, 16, 2}, w.options());
  const int32_t* src = reinterpret_cast<const int32_t*>(w.data_ptr());  // k-pairs
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t p, lane;  // lane = 16 v + j
      panel_lane(n, gated, d, p, lane);
      for (int64_t kp = 0; kp < K2; ++kp) dst[(p * K2 + kp) * kPanel + lane] = src[n * K2 + kp];
    }
  });
  return out;
}

// kGatedGelu and kGatedSwiglu: the fused MoE's (moe.h), not gemm_linear's.
enum Epilogue { kPlain, kGatedSplit, kGatedSilu, kPlainFloat, kGatedGelu, kGatedSwiglu,
                kEpilogues };

// What a tile's epilogue adds besides the sums: a gated weight's d (up's offset in a gated bias
// and in kGatedSplit's output), this panel's bias (plain: its 48 outputs; gated: gate's 24, up's
// d further on; nullptr: none) and kGatedSwiglu's activation.
struct TileEpilogue {
  int64_t d = 0;
  const at::BFloat16* bias = nullptr;
  SwigluOaiMul swiglu{1.702, std::numeric_limits<double>::infinity()};
};

// What gemm_linear and qgemm_linear (qgemm.h) share: their checks of x, the epilogue, the
// panels' count and the bias (errors prefixed by `name`), the output y [M, ldc], and how
// outputs fall to panels (`width` a panel: 48, or 24 gated; `outputs`: N, or d gated). Each
// checks its own layout of the packed weight besides.
struct LinearCall {
  int64_t M, K, d, width, outputs, ldc;
  torch::Tensor y;
};

static LinearCall linear_call(const char* name, const torch::Tensor& x, int64_t panels,
                              int64_t N, const c10::optional<torch::Tensor>& bias,
                              int64_t epilogue) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be a contiguous bf16 [M, K]");
  TORCH_CHECK(epilogue >= 0 && epilogue <= 3 && (epilogue % 3 == 0 || N % 2 == 0), name,
              ": epilogue 0 / 3, or 1 / 2 for a gated weight");
  const bool gated = epilogue == kGatedSplit || epilogue == kGatedSilu;
  LinearCall call;
  call.M = x.size(0), call.K = x.size(1), call.d = N / 2;
  call.width = gated ? kHalf : kPanel;
  call.outputs = gated ? call.d : N;
  call.ldc = epilogue == kGatedSilu ? call.d : N;
  TORCH_CHECK(panels * call.width >= call.outputs && (panels - 1) * call.width < call.outputs,
              name, ": shapes");
  TORCH_CHECK(!bias.has_value() || (!gated && bias->scalar_type() == at::kBFloat16 &&
                                    bias->is_contiguous() && bias->numel() == N),
              name, ": a contiguous bf16 bias of N values (plain epilogue only)");
  call.y = torch::empty({call.M, call.ldc}, x.options().dtype(
                                                epilogue == kPlainFloat ? at::kFloat
                                                                        : at::kBFloat16));
  return call;
}

#ifdef ASERVE_AMX
static thread_local int amx_rows = 0;  // the C and A tiles' rows this thread configured; 0: none
#endif

// The end of a thread's share of panel_rows calls: its tile state is given back (a thread
// holding it saves 8 KB more at every context switch). Every build has it (moe.h's task loop
// calls it); without AMX it does nothing.
static inline void panel_rows_done() {
#ifdef ASERVE_AMX
  if (amx_rows != 0) _tile_release(), amx_rows = 0;
#endif
}

// Every (panel, 64-row block) task of a call over the threads, panel-major (a thread reuses a
// panel from L2 across row blocks): run(p, m0, rows, cols, ep), ep's bias the panel's (bias:
// nullptr for none). Each thread's share ends by giving back its tile state and fencing
// kPlainFloat's streaming stores (AVX-512's), so they are visible before the caller reads them.
// Every build's tiles (gemm_avx2.h's too) share it.
template <typename Run>
static void for_each_panel_task(const LinearCall& call, int64_t panels,
                                const at::BFloat16* bias, Run&& run) {
  const int64_t blocks = (call.M + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
    TileEpilogue ep;
    ep.d = call.d;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / blocks, m0 = (task % blocks) * kRowBlock;
      ep.bias = bias == nullptr ? nullptr : bias + p * kPanel;
      run(p, m0, std::min(kRowBlock, call.M - m0),
          std::min(call.width, call.outputs - p * call.width), ep);
    }
    panel_rows_done();
#ifdef ASERVE_GEMM
    _mm_sfence();
#endif
  });
}

#ifdef ASERVE_GEMM

// The R x 48 float sums of a tile into `out`. kPlain: columns [0, cols) (+ bias) as bf16;
// kPlainFloat: the same bf16 values as float32 (whole lines by streaming stores). A gated
// panel's 24 gate and 24 up sums of outputs [0, cols), each (+ its bias) rounded to bf16:
// kGatedSplit stores both (up at column d); kGatedSilu / kGatedGelu / kGatedSwiglu store
// bf16(act(g, u)) (activation.h): the arithmetic of storing gate_up and applying the
// element-wise op, bit for bit.
template <int R, int E>
static inline void store_tile(__m512 (&acc)[R][kVecs], void* out, int64_t ldc, int64_t cols,
                              const TileEpilogue& ep) {
  const at::BFloat16* bias = ep.bias;
  if (E == kPlain || E == kPlainFloat) {
    for (int v = 0; v < kVecs && 16 * v < cols; ++v) {
      const __mmask16 m = tail_mask(cols - 16 * v);
      const __m512 bv = bias != nullptr ? load_bf16(bias + 16 * v, m) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m512 y = _mm512_add_ps(acc[r][v], bv);
        if (E == kPlain) {
          store_bf16(static_cast<at::BFloat16*>(out) + r * ldc + 16 * v, y, m);
          continue;
        }
        float* f = static_cast<float*>(out) + r * ldc + 16 * v;  // the bf16 value as float32
        if (m == 0xFFFF && (reinterpret_cast<uintptr_t>(f) & 63) == 0)
          _mm512_stream_ps(f, round_bf16(y));  // whole lines: no read for ownership
        else
          _mm512_mask_storeu_ps(f, m, round_bf16(y));
      }
    }
    return;
  }
  const int64_t d = ep.d;
  at::BFloat16* c = static_cast<at::BFloat16*>(out);
  for (int i = 0; i < 2 && 16 * i < cols; ++i) {
    const __mmask16 m = tail_mask(std::min<int64_t>(cols - 16 * i, 16 - 8 * i));
    __m512 gate_bias = _mm512_setzero_ps(), up_bias = _mm512_setzero_ps();
    if (bias != nullptr)
      gate_bias = load_bf16(bias + 16 * i, m), up_bias = load_bf16(bias + d + 16 * i, m);
    for (int r = 0; r < R; ++r) {
      at::BFloat16* row = c + r * ldc;
      // outputs 0..15: vectors 0 and 1; 16..23: the halves of vector 2 (up's swapped down)
      __m512 g = i == 0 ? acc[r][0] : acc[r][2];
      __m512 u = i == 0 ? acc[r][1] : _mm512_shuffle_f32x4(acc[r][2], acc[r][2], 0x4E);
      if (bias != nullptr) g = _mm512_add_ps(g, gate_bias), u = _mm512_add_ps(u, up_bias);
      g = round_bf16(g), u = round_bf16(u);
      if (E == kGatedSplit) {
        store_bf16(row + 16 * i, g, m);
        store_bf16(row + d + 16 * i, u, m);
      } else if (E == kGatedSilu) {
        store_bf16(row + 16 * i, SiluMul{}(g, u), m);
      } else if (E == kGatedGelu) {
        store_bf16(row + 16 * i, GeluTanhMul{}(g, u), m);
      } else {
        store_bf16(row + 16 * i, ep.swiglu(g, u), m);
      }
    }
  }
}

// c[0:R, 0:cols] = a[0:R, :] @ panel, stored by epilogue E; R <= 8 rows of a (stride lda).
template <int R, int E>
static void tile(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel, int64_t K2,
                 void* c, int64_t ldc, int64_t cols, const TileEpilogue& ep) {
  __m512 acc[R][kVecs];
  ASERVE_UNROLL for (int r = 0; r < R; ++r)
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const int64_t lda32 = lda / 2;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i b[kVecs];
    ASERVE_UNROLL for (int v = 0; v < kVecs; ++v)
      b[v] = _mm512_loadu_si512(panel + (kp * kVecs + v) * 32);
    ASERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(a32[r * lda32 + kp]);
      ASERVE_UNROLL for (int v = 0; v < kVecs; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)x, (__m512bh)b[v]);
    }
  }
  store_tile<R, E>(acc, c, ldc, cols, ep);
}

using Tile = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, void*, int64_t,
                      int64_t, const TileEpilogue&);
#define ASERVE_TILES(E)                                                              \
  {nullptr, tile<1, E>, tile<2, E>, tile<3, E>, tile<4, E>, tile<5, E>, tile<6, E>,   \
   tile<7, E>, tile<8, E>}
static const Tile kTiles[kEpilogues][kRows + 1] = {
    ASERVE_TILES(kPlain),      ASERVE_TILES(kGatedSplit), ASERVE_TILES(kGatedSilu),
    ASERVE_TILES(kPlainFloat), ASERVE_TILES(kGatedGelu),  ASERVE_TILES(kGatedSwiglu)};
#undef ASERVE_TILES

// c[0:M, 0:cols] = a[0:M, :] (stride K) @ one panel (K / 2 k-pairs), 8 rows per tile, stored by
// `tiles` (one epilogue's row of kTiles) into c (row stride ldc, `item` bytes per element).
static inline void vector_panel_rows(const Tile* tiles, const at::BFloat16* a, int64_t M,
                                     int64_t K, const at::BFloat16* panel, char* c, int64_t ldc,
                                     int64_t item, int64_t cols, const TileEpilogue& ep) {
  for (int64_t m = 0; m < M; m += kRows)
    tiles[std::min(kRows, M - m)](a + m * K, K, panel, K / 2, c + m * ldc * item, ldc, cols, ep);
}

#ifdef ASERVE_AMX
// AMX (Sapphire Rapids and later): the same panels feed the tile unit. A B tile is 16 k-pairs x
// 16 outputs x 2, which is one vector's slice of a panel (its rows 192 bytes apart), so the
// packing is shared with the vector tiles. The results agree with theirs to one bf16 step, most
// of them bit for bit (the tile unit rounds its sums its own way).
//
//   tmm0-2: C, m rows x 16 float32 (the panel's 3 vectors)    tmm3: A, m rows x 32 bf16 of x
//   tmm4-6: B, 16 k-pairs x 16 outputs x 2 (K in steps of 32)  (m: 16, or M when M < 16)

// Linux hands out the tile state only to a process that asks (arch_prctl); whether it did.
static bool amx_enabled() {
  static const bool enabled = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit AmxConfig(int m) {
    for (int t = 0; t < 7; ++t) colsb[t] = 64, rows[t] = t < 4 ? m : 16;
  }
};

static inline void amx_configure(int m) {
  if (amx_rows == m) return;
  const AmxConfig config(m);
  _tile_loadconfig(&config);
  amx_rows = m;
}

// Tile loads wait on memory: a decode step's GEMMs (a few rows against every weight once)
// streamed the weights at 0.77x the rate of a plain read. So the first group of rows fetches
// its panel kAmxAhead k-steps ahead into L1 (a k-step: 16 k-pairs x 48 outputs, 48 lines), and
// the second, which finds the panel in L2, fetches the same k-step of the next panel (the next
// task's: panels are contiguous) into L2. Prefetches do not fault: past the last panel they
// fetch nothing of use and harm nothing. smol's decode-step weights (huge pages), GB/s beside a
// plain read's 15.8-18.6: 1 row 12.2 -> 16.3-17.8, 16 rows 11.5 -> 14-15, 32 rows 10.8 -> 12.4.
constexpr int64_t kAmxAhead = 2;
constexpr int64_t kAmxStep = 32 * kPanel;  // bf16 elements of a panel per k-step (32 k)

template <int Hint>
static inline void amx_prefetch(const at::BFloat16* b) {
  const char* line = reinterpret_cast<const char*>(b);
  ASERVE_UNROLL for (int i = 0; i < kVecs * 16; ++i)
    _mm_prefetch(line + i * 64, static_cast<_mm_hint>(Hint));
}

// c[0:M, 0:cols] = a[0:M, :] @ one panel by AMX tiles of 16 rows (a last group of fewer is
// computed as rows [M - 16, M), only its new rows stored), or one tile of M < 16 rows.
template <int E>
static void amx_panel_rows(const at::BFloat16* a, int64_t M, int64_t K,
                           const at::BFloat16* panel, char* c, int64_t ldc, int64_t item,
                           int64_t cols, const TileEpilogue& ep) {
  amx_configure(static_cast<int>(std::min<int64_t>(M, 16)));
  alignas(64) float sums[16][kPanel];
  constexpr int64_t kPanelRow = kVecs * 64;  // bytes between a panel's k-pairs
  for (int64_t m = 0; m < M; m += 16) {
    const int64_t start = std::max<int64_t>(0, std::min(m, M - 16));
    const at::BFloat16* x = a + start * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < K; k += 32) {
      const at::BFloat16* b = panel + k * kPanel;  // the panel's k-pair k / 2
      if (m == 0) amx_prefetch<_MM_HINT_T0>(b + kAmxAhead * kAmxStep);
      else if (m == 16) amx_prefetch<_MM_HINT_T1>(b + K * kPanel);  // the next panel's
      _tile_loadd(3, x + k, K * 2);
      _tile_loadd(4, b, kPanelRow);
      _tile_loadd(5, b + 32, kPanelRow);
      _tile_loadd(6, b + 64, kPanelRow);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 3, 5);
      _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, &sums[0][0], kPanel * 4);
    _tile_stored(1, &sums[0][16], kPanel * 4);
    _tile_stored(2, &sums[0][32], kPanel * 4);
    for (int64_t r = m - start; r < std::min<int64_t>(16, M - start); ++r) {
      __m512 acc[1][kVecs] = {{_mm512_load_ps(&sums[r][0]), _mm512_load_ps(&sums[r][16]),
                               _mm512_load_ps(&sums[r][32])}};
      store_tile<1, E>(acc, c + (start + r) * ldc * item, ldc, cols, ep);
    }
  }
}

using AmxRows = void (*)(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, char*,
                         int64_t, int64_t, int64_t, const TileEpilogue&);
static const AmxRows kAmxRows[kEpilogues] = {
    amx_panel_rows<kPlain>,      amx_panel_rows<kGatedSplit>, amx_panel_rows<kGatedSilu>,
    amx_panel_rows<kPlainFloat>, amx_panel_rows<kGatedGelu>,  amx_panel_rows<kGatedSwiglu>};
#endif

// c[0:M, 0:cols] = a[0:M, :] (stride K) @ one panel, stored by `epilogue` into c (row stride
// ldc, `item` bytes per element): by AMX tiles where `amx` (use_amx(K)), else vector tiles.
static inline void panel_rows(int epilogue, bool amx, const at::BFloat16* a, int64_t M,
                              int64_t K, const at::BFloat16* panel, char* c, int64_t ldc,
                              int64_t item, int64_t cols, const TileEpilogue& ep) {
#ifdef ASERVE_AMX
  if (amx) return kAmxRows[epilogue](a, M, K, panel, c, ldc, item, cols, ep);
#endif
  vector_panel_rows(kTiles[epilogue], a, M, K, panel, c, ldc, item, cols, ep);
}


#endif

// Whether GEMMs over K go to the AMX tiles: wherever the CPU has them, at every row count (a
// 2-core Xeon with AMX, smol's [1536, 576] weight: 16 us at 1 row against the vector tiles' 20,
// 16 at 8 rows against 67; BENCHMARKS.md, "On a Xeon with AMX").
static std::atomic<bool> amx_allowed{true};  // gemm_amx(0) turns the tiles off (tests, A/B)

static inline bool use_amx(int64_t K) {
#ifdef ASERVE_AMX
  return K % 32 == 0 && amx_allowed.load(std::memory_order_relaxed) && amx_enabled();
#else
  return false;
#endif
}

// mode 0: vector tiles only; 1: AMX where the CPU has it; -1: no change. Whether GEMMs (over K
// a multiple of 32) now run on AMX tiles.
bool gemm_amx(int64_t mode) {
  if (mode >= 0) amx_allowed = mode != 0;
  return use_amx(32);
}

// AVX2 hosts: the same panels by 8-wide tiles (defines ASERVE_GEMM_AVX2 where they build).
#include "gemm_avx2.h"

// Which tiles run gemm_linear here: "avx512" (AVX512-BF16), "avx2", or "" (none: the caller
// keeps oneDNN or F.linear).
std::string gemm_isa() {
#if defined(ASERVE_GEMM)
  return "avx512";
#elif defined(ASERVE_GEMM_AVX2)
  return "avx2";
#else
  return "";
#endif
}

// y = x [M, K] @ W^T for the packed W [N, K] (x contiguous bf16): epilogue 0 (kPlain),
// y [M, N] (+ bias [N]); 3 (kPlainFloat), the same bf16 values as float32 (logits: whole lines
// go out with streaming stores, since a [64, 49152] float32 output fits no cache); for a
// gated pack, 1 (kGatedSplit) y [M, N] = [gate | up], or 2 (kGatedSilu) y [M, N / 2] =
// silu(gate) * up.
torch::Tensor gemm_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                          c10::optional<torch::Tensor> bias, int64_t epilogue) {
  TORCH_CHECK(!gemm_isa().empty(), "cpu_gemm.linear: built without AVX512-BF16 or AVX2");
  const LinearCall call = linear_call("cpu_gemm.linear", x, packed.size(0), N, bias, epilogue);
  const int64_t K = call.K, K2 = K / 2, ldc = call.ldc;
  TORCH_CHECK(packed.size(1) == K2, "cpu_gemm.linear: shapes");
#ifdef ASERVE_GEMM
  const at::BFloat16* a = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  char* c = static_cast<char*>(call.y.data_ptr());
  const int64_t item = call.y.element_size();
  const bool amx = use_amx(K);
  for_each_panel_task(call, packed.size(0),
                      bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
                      [&](int64_t p, int64_t m0, int64_t rows, int64_t cols,
                          const TileEpilogue& ep) {
                        panel_rows(epilogue, amx, a + m0 * K, rows, K, w + p * K2 * kPanel * 2,
                                   c + (m0 * ldc + p * call.width) * item, ldc, item, cols, ep);
                      });
#elif defined(ASERVE_GEMM_AVX2)
  const at::BFloat16* a = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  char* c = static_cast<char*>(call.y.data_ptr());
  const int64_t item = call.y.element_size();
  for_each_panel_task(
      call, packed.size(0), bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
      [&](int64_t p, int64_t m0, int64_t rows, int64_t cols, const TileEpilogue& ep) {
        bf16_panel_rows_avx2(static_cast<int>(epilogue), a + m0 * K, rows, K,
                             w + p * K2 * kPanel * 2, c + (m0 * ldc + p * call.width) * item,
                             ldc, item, cols, ep);
      });
#endif
  return call.y;
}
