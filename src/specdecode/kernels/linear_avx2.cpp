// Linear layers for CPUs with AVX2 + FMA, made for decoding: few tokens, big weights. Weights
// come as bfloat16 (the model's own) or as int8 with one scale per output row (a draft's weights
// quantized by `quantize_linears`: half the bytes to read), in packed 16-row panels
// (`linear_packed`, `linear_int8_packed`: see "Packed panels" below), or at 4 bits on 8-bit
// activations (`linear_int4_packed`, "int4 panels" below); bfloat16 weights with an odd K run on
// plain rows (`linear`).
//
// Why: on x86 CPUs without bfloat16 matrix units, PyTorch's bfloat16 matmul costs about one extra
// one-token forward per extra token, so verifying k+1 drafted tokens costs about k+1 forwards and
// speculation cannot pay (docs/results.md). Here
// every weight row is read from memory once per call and used for all
// the tokens while it sits in L1, so a forward over a few tokens costs about as much as over one:
// the memory-bound regime speculative decoding is built on.
//
// Batch invariance: each output is one float32 sum over k in a fixed order (rows: 8 lanes, each
// an FMA chain over its k in order, then the lanes added in a fixed order; panels: one FMA chain
// over all k), whatever the number of tokens in the call or the tile that computes it. A linear
// layer's output for a token is bit-identical whether the token is decoded alone or verified
// among k others. (Attention and the rest of the model can still round differently with the
// number of tokens, so bfloat16 greedy identity keeps its near-tie exception.) Activations are
// float32 inside (int8 for 4-bit weights), bfloat16 in and out.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_tile.h"
#include "kernel_common.h"
#include "q6_tile.h"
#include "kernel_ops.h"

namespace specdecode_kernels {  // linear_avx512.cpp: the bfloat16 panels on AVX-512 BF16
bool bf16_dot_supported();
int64_t bf16_dot_width(int64_t M);  // panels per work item for M tokens
int64_t bf16_dot_prefetch(int64_t elements);  // set (> 0) and return the prefetch distance
void bf16_dot_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels, int64_t N,
                     const float* bias, uint16_t* out, int64_t p0, int64_t p1);
bool int4_vnni_supported();
bool int8_avx512_supported();
bool bf16_amx_supported();  // linear_amx.cpp: the bfloat16 panels on AMX tiles
void bf16_amx_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels, int64_t N,
                     const float* bias, uint16_t* out, int64_t p0, int64_t p1, bool packed);
void int8_avx512_tile(int64_t mr, int64_t panels, const int8_t* p, int64_t K, int64_t pstride,
                      const float* x, float* res);
void int4_bf16_panel(const uint8_t* p, const uint8_t* codes, const uint16_t* steps, int shift,
                     int64_t K, uint16_t* out);  // linear_amx.cpp: for prefills on AMX
void q6_bf16_panel(const uint8_t* lo, const uint8_t* hi, const int8_t* sc, const uint16_t* d,
                   int64_t K, uint16_t* out);
int64_t int4_vnni_tile_rows();
void int4_vnni_tile(int64_t mr, const uint8_t* p, const uint8_t* codes, const uint16_t* steps,
                    int shift, int64_t K, const int8_t* xq, const float* dx, const float* xsum,
                    float* res);
int64_t q6_vnni_tile_rows();
void q6_vnni_tile(int64_t mr, const uint8_t* lo, const uint8_t* hi, const int8_t* sc,
                  const uint16_t* d, int64_t K, const int8_t* xq, const int32_t* xs,
                  const float* dx, float* res);
}  // namespace specdecode_kernels

namespace {

// Whether bfloat16 panels run on AVX-512 BF16 (linear_avx512.cpp) rather than on AVX2 FMAs:
// where the CPU has it, unless `set_bf16_dot(false)`. One switch for the whole process, so that
// decoding one token and verifying several round alike.
bool g_bf16_dot = specdecode_kernels::bf16_dot_supported();
// Whether bfloat16 panels whose K is a multiple of 32 run on AMX tiles (linear_amx.cpp), before
// either of the above: where the CPU and the OS allow it, unless `set_bf16_amx(false)`. One
// switch for the whole process, for the same reason.
bool g_bf16_amx = specdecode_kernels::bf16_amx_supported();
// Whether the int4 and 6-bit tiles run on AVX-512 VNNI (bit-identical to AVX2, fewer
// instructions): where the CPU has it, unless `set_int4_vnni(false)` (for comparisons).
bool g_int4_vnni = specdecode_kernels::int4_vnni_supported();
// Whether the int8 tile runs on AVX-512 F (bit-identical to AVX2, half the instructions): where
// the CPU has it, unless `set_int8_avx512(false)` (for comparisons).
bool g_int8_avx512 = specdecode_kernels::int8_avx512_supported();

constexpr int64_t kGroup = 8;     // weight rows per parallel work item (24 KB when K = 1536)
constexpr int64_t kPrefetch = 8;  // prefetch the same place kPrefetch rows ahead (the next group)
constexpr int64_t kPanel = 16;    // outputs per packed panel (bfloat16 weights, see linear_packed)
constexpr int64_t kPanelPrefetch = 8192;  // elements ahead within a panel (16 KB)

// Small loops over a tile's accumulators must be unrolled completely: otherwise GCC keeps the
// accumulator array in memory and stores all of it back on every step of the k loop.
#define SD_UNROLL _Pragma("GCC unroll 16")

using specdecode_kernels::bf16_to_float;
using specdecode_kernels::float_to_bf16;
using specdecode_kernels::lane_sum;
using specdecode_kernels::with_tile_rows;

// The row format (a template parameter of the row tiles): widens 16 consecutive weights of a row
// to two float32 vectors (`load16`) that multiply the matching two vectors of a token's prepared
// activations.
struct Bf16Rows {  // bfloat16; activations as [8 even | 8 odd] per 16-chunk: one shift, one mask
  using T = uint16_t;
  static constexpr bool kEvenOdd = true;
  static inline void load16(const T* p, __m256& a, __m256& b) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  static inline float at(const T* p) { return bf16_to_float(*p); }
};

// R weight rows x T tokens: res[t * R + r] = dot(w[r], x[t]), x prepared for the format W.
template <class W, int R, int T>
inline void tile(const typename W::T* w, int64_t K, const float* x, float* res) {
  __m256 acc[R][T];
  SD_UNROLL for (int r = 0; r < R; ++r)
    SD_UNROLL for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 lo[T], hi[T];
    SD_UNROLL for (int t = 0; t < T; ++t) {
      lo[t] = _mm256_loadu_ps(x + t * K + k);
      hi[t] = _mm256_loadu_ps(x + t * K + k + 8);
    }
    SD_UNROLL for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetch + r) * K + k), _MM_HINT_T0);
      __m256 w_lo, w_hi;
      W::load16(w + r * K + k, w_lo, w_hi);
      SD_UNROLL for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm256_fmadd_ps(w_lo, lo[t], acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(w_hi, hi[t], acc[r][t]);
      }
    }
  }
  SD_UNROLL for (int r = 0; r < R; ++r)
    SD_UNROLL for (int t = 0; t < T; ++t) {
      float s = lane_sum(acc[r][t]);
      for (int64_t k = K16; k < K; ++k) s += W::at(w + r * K + k) * x[t * K + k];
      res[t * R + r] = s;
    }
}

struct Out {  // where results go: out[m, n] = bf16(sum * scale[n] + bias[n])
  const float* scale;  // [N] or nullptr (bfloat16 weights)
  const float* bias;   // [N] or nullptr
  int64_t N;
  uint16_t* out;       // [M, N]
  int64_t M;           // rows of out (panel tiles may compute padding rows past it)
};

// out[m0 .. m0+T, n0 .. n0+R] = x[m0 .. m0+T] @ w[n0 .. n0+R]^T (scaled) + bias, in bfloat16.
template <class W, int R, int T>
inline void block(const typename W::T* w, int64_t K, const float* x, int64_t n0, int64_t m0,
                  const Out& o) {
  float res[R * T];
  tile<W, R, T>(w, K, x + m0 * K, res);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      const float s = o.scale ? res[t * R + r] * o.scale[n] : res[t * R + r];
      o.out[(m0 + t) * o.N + n] = float_to_bf16(s + (o.bias ? o.bias[n] : 0.f));
    }
}

// One group of kGroup weight rows against all M tokens: blocks of 4 tokens, then the 1-3 left,
// each tile shape keeping about 8 independent accumulators busy (FMA latency x 2 pipes).
template <class W>
void group(const typename W::T* w, int64_t K, const float* x, int64_t M, int64_t n0,
           const Out& o) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int r = 0; r < kGroup; r += 2) block<W, 2, 4>(w + r * K, K, x, n0 + r, m, o);
  switch (M - m) {
    case 3:
      for (int r = 0; r < kGroup; r += 2) block<W, 2, 3>(w + r * K, K, x, n0 + r, m, o);
      break;
    case 2:
      for (int r = 0; r < kGroup; r += 4) block<W, 4, 2>(w + r * K, K, x, n0 + r, m, o);
      break;
    case 1:
      for (int r = 0; r < kGroup; r += 4) block<W, 4, 1>(w + r * K, K, x, n0 + r, m, o);
      break;
  }
}

// x [M, K] bfloat16 -> float32, each 16-wide chunk reordered to [8 even | 8 odd] when W wants
// it. A plain loop rather than tensor ops: at decode sizes the dozen small ATen calls it replaces
// cost more than the conversion itself (about 170 linears per forward).
template <class W>
std::vector<float> prepare(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), K16 = K & ~int64_t(15);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> xf(size_t(M * K));
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = src + m * K;
    float* dst = xf.data() + m * K;
    for (int64_t k = 0; k < K16; k += 16)
      for (int i = 0; i < 8; ++i) {
        dst[k + i] = bf16_to_float(row[k + (W::kEvenOdd ? 2 * i : i)]);
        dst[k + 8 + i] = bf16_to_float(row[k + (W::kEvenOdd ? 2 * i + 1 : 8 + i)]);
      }
    for (int64_t k = K16; k < K; ++k) dst[k] = bf16_to_float(row[k]);
  }
  return xf;
}

// bias [N] (bfloat16 or float32) -> float32, or empty without one
std::vector<float> bias_float(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->device().is_cpu(),
              "linear: a contiguous CPU bias [N] expected");
  std::vector<float> out(static_cast<size_t>(N));
  if (bias->scalar_type() == at::kFloat) {
    std::memcpy(out.data(), bias->data_ptr<float>(), size_t(N) * sizeof(float));
  } else {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16, "linear: bfloat16 or float32 bias expected");
    const auto* b = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
    for (int64_t n = 0; n < N; ++n) out[size_t(n)] = bf16_to_float(b[n]);
  }
  return out;
}

template <class W>
torch::Tensor run(const torch::Tensor& x, const typename W::T* w, int64_t N, const float* scale,
                  const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<float> xf = prepare<W>(x);
  const std::vector<float> bias_f = bias_float(bias, N);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Out o{scale, bias_f.empty() ? nullptr : bias_f.data(), N,
              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), M};
  const float* X = xf.data();
  const int64_t groups = N / kGroup;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group<W>(w + g * kGroup * K, K, X, M, g * kGroup, o);
  });
  for (int64_t n = groups * kGroup; n < N; ++n)  // rows left over: one at a time
    for (int64_t m = 0; m < M; ++m) block<W, 1, 1>(w + n * K, K, X, n, m, o);
  return out;
}

// ---- Packed panels (bfloat16 weights, K even) --------------------------------------------
// The row tiles above need one activation load per FMA and a horizontal sum per output; from a
// few tokens on they are compute-bound well below the FMA peak, so verifying a handful of tokens
// costs well over one one-token forward. Panels put 16 output rows side by side: panel p
// holds rows 16p .. 16p+15 as [K/2][16][2] bfloat16 (for each pair of k, a row's two weights in
// one 32-bit lane, k even in the low half), so one 256-bit load gives 8 rows' weights at k (a
// shift) and at k+1 (a mask), and a tile of MR tokens x 8V rows does MR x V FMAs per broadcast
// activation, with no horizontal sum: a forward over a few tokens then costs about one
// one-token forward again (docs/results.md).
// Each output is one float32 FMA chain over k in order whatever the tile: batch invariant.
// int8 panels (a draft's quantized weights): [K][16] int8 per panel, one float32 scale per row
// applied after the sum, like the int8 rows. No pairs of k: 8 weights widen with one sign
// extension and one conversion.

// Panel formats: `tile<MR, V>` computes res[t * 8V + i] = dot(row i of the tile, x[t]) where
// vector v of the tile (8 rows) is panel v / 2, half v % 2.
struct Bf16Panels {
  using T = uint16_t;
  static constexpr bool kEvenOdd = false;  // activations as is (for prepare)
  // half v % 2 sits 16 elements into each 32-element pair-of-k line of its panel
  template <int MR, int V>
  static inline void tile(const T* p, int64_t K, int64_t pstride, const float* x, float* res) {
    __m256 acc[MR][V];
    SD_UNROLL for (int t = 0; t < MR; ++t)
      SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
    for (int64_t j = 0; j < K / 2; ++j) {
      __m256 wv[V];
      SD_UNROLL for (int v = 0; v < V; ++v) {  // weights at k = 2j: the low halves, shifted up
        const T* q = p + (v / 2) * pstride + (v % 2) * 16 + j * 32;
        if (v % 2 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(q + kPanelPrefetch), _MM_HINT_T0);
        wv[v] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), 16));
      }
      SD_UNROLL for (int t = 0; t < MR; ++t) {
        const __m256 xe = _mm256_broadcast_ss(x + t * K + 2 * j);
        SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(wv[v], xe, acc[t][v]);
      }
      SD_UNROLL for (int v = 0; v < V; ++v) {  // weights at k = 2j + 1: the high halves
        const T* q = p + (v / 2) * pstride + (v % 2) * 16 + j * 32;
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        // 12 accumulators leave no register for the mask: two shifts instead
        wv[v] = _mm256_castsi256_ps(MR * V >= 12
                                        ? _mm256_slli_epi32(_mm256_srli_epi32(raw, 16), 16)
                                        : _mm256_and_si256(raw, high));
      }
      SD_UNROLL for (int t = 0; t < MR; ++t) {
        const __m256 xo = _mm256_broadcast_ss(x + t * K + 2 * j + 1);
        SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(wv[v], xo, acc[t][v]);
      }
    }
    SD_UNROLL for (int t = 0; t < MR; ++t)
      SD_UNROLL for (int v = 0; v < V; ++v) _mm256_storeu_ps(res + (t * V + v) * 8, acc[t][v]);
  }
};

struct Int8Panels {
  using T = int8_t;
  static constexpr bool kEvenOdd = false;
  // half v % 2 sits 8 bytes into each 16-byte line (one k) of its panel
  template <int MR, int V>
  static inline void step(const T* p, int64_t K, int64_t pstride, const float* x, int64_t k,
                          __m256 (&acc)[MR][V]) {
    __m256 wv[V];
    SD_UNROLL for (int v = 0; v < V; ++v) {
      const T* q = p + (v / 2) * pstride + (v % 2) * 8 + k * 16;
      wv[v] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    }
    SD_UNROLL for (int t = 0; t < MR; ++t) {
      const __m256 xk = _mm256_broadcast_ss(x + t * K + k);
      SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(wv[v], xk, acc[t][v]);
    }
  }
  template <int MR, int V>
  static inline void tile(const T* p, int64_t K, int64_t pstride, const float* x, float* res) {
    if (g_int8_avx512)
      return specdecode_kernels::int8_avx512_tile(MR, V / 2, p, K, pstride, x, res);
    __m256 acc[MR][V];
    SD_UNROLL for (int t = 0; t < MR; ++t)
      SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {  // four k per iteration: one 64-byte line per panel
      SD_UNROLL for (int v = 0; v < V; v += 2)
        _mm_prefetch(reinterpret_cast<const char*>(p + (v / 2) * pstride + k * 16 + kPanelPrefetch),
                     _MM_HINT_T0);
      SD_UNROLL for (int u = 0; u < 4; ++u) step<MR, V>(p, K, pstride, x, k + u, acc);
    }
    for (; k < K; ++k) step<MR, V>(p, K, pstride, x, k, acc);
    SD_UNROLL for (int t = 0; t < MR; ++t)
      SD_UNROLL for (int v = 0; v < V; ++v) _mm256_storeu_ps(res + (t * V + v) * 8, acc[t][v]);
  }
};

// out[m0 .. m0+MR, n0 .. n0+8V] (the rows below N) from the panels at p
template <class F, int MR, int V>
inline void panel_block(const typename F::T* p, int64_t K, int64_t pstride, const float* x,
                        int64_t m0, int64_t n0, const Out& o) {
  float res[MR * V * 8];
  F::template tile<MR, V>(p, K, pstride, x + m0 * K, res);
  const int64_t rows = std::min<int64_t>(V * 8, o.N - n0);
  for (int t = 0; t < MR && m0 + t < o.M; ++t)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = n0 + i;
      const float sum = o.scale ? res[t * V * 8 + i] * o.scale[n] : res[t * V * 8 + i];
      o.out[(m0 + t) * o.N + n] = float_to_bf16(sum + (o.bias ? o.bias[n] : 0.f));
    }
}

// One panel against M >= 3 tokens (M a padded count, see run_panels): blocks of 4-6 tokens
// (6 x 16 outputs = 12 accumulators, all the registers there are), as few blocks as possible,
// of near-equal size.
template <class F>
void panel_tokens(const typename F::T* p, int64_t K, int64_t pstride, const float* x, int64_t M,
                  int64_t n0, const Out& o) {
  const int64_t blocks = (M + 5) / 6;
  int64_t m = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t mr = (M - m) / (blocks - b);
    switch (mr) {
      case 6: panel_block<F, 6, 2>(p, K, pstride, x, m, n0, o); break;
      case 5: panel_block<F, 5, 2>(p, K, pstride, x, m, n0, o); break;
      case 4: panel_block<F, 4, 2>(p, K, pstride, x, m, n0, o); break;
      default: panel_block<F, 4, 2>(p, K, pstride, x, m, n0, o); break;
    }
    m += mr;
  }
}

template <class F>
torch::Tensor run_panels(const torch::Tensor& x, const typename F::T* panels, int64_t N,
                         const float* scale, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> xf = prepare<F>(x);
  const std::vector<float> bias_f = bias_float(bias, N);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Out o{scale, bias_f.empty() ? nullptr : bias_f.data(), N,
              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), M};
  // A block of 3 tokens has 6 accumulators for 8 FMAs in flight: it costs about what 4 do.
  // So 3 and 7 tokens compute a zero row more (4, 4 + 4), whose outputs are not written.
  const int64_t blocks = (M + 5) / 6;
  const int64_t padded = M >= 3 ? std::max(M, 4 * blocks) : M;
  xf.resize(size_t(padded * K), 0.f);
  const float* X = xf.data();
  const int64_t P = (N + kPanel - 1) / kPanel, pstride = K * kPanel;
  if (M <= 2) {  // two panels per tile: 8 accumulators for one or two tokens
    at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const typename F::T* p = panels + 2 * u * pstride;
        const bool pair = 2 * u + 1 < P;
        if (M == 1) {
          pair ? panel_block<F, 1, 4>(p, K, pstride, X, 0, 2 * u * kPanel, o)
               : panel_block<F, 1, 2>(p, K, pstride, X, 0, 2 * u * kPanel, o);
        } else {
          pair ? panel_block<F, 2, 4>(p, K, pstride, X, 0, 2 * u * kPanel, o)
               : panel_block<F, 2, 2>(p, K, pstride, X, 0, 2 * u * kPanel, o);
        }
      }
    });
  } else {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        panel_tokens<F>(panels + p * pstride, K, pstride, X, padded, p * kPanel, o);
    });
  }
  return out;
}

void check_x(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear: bfloat16 activations expected");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() &&
                  weight.device().is_cpu(),
              "linear: contiguous CPU x and weight expected");
}

}  // namespace

// x: [M, K] bfloat16, weight: [N, K] bfloat16 contiguous, bias: [N] or None -> [M, N] bfloat16.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  check_x(x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear: bfloat16 weight expected");
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  return run<Bf16Rows>(x, w, weight.size(0), nullptr, bias);
}

// x: [M, K] bfloat16 (K even), panels: contiguous bfloat16 holding ceil(N / 16) panels of
// [K / 2][16][2] (see "Packed panels"; rows past N zero), bias: [N] or None -> [M, N] bfloat16.
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor panels, int64_t N,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "linear_packed: x [M, K] with K even expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16,
              "linear_packed: bfloat16 activations and panels expected");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous() && x.device().is_cpu() &&
                  panels.device().is_cpu(),
              "linear_packed: contiguous CPU x and panels expected");
  TORCH_CHECK(N >= 0 && panels.numel() == (N + kPanel - 1) / kPanel * kPanel * x.size(1),
              "linear_packed: panels must hold ceil(N / 16) * 16 * K weights");
  const auto* p = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  const int64_t M = x.size(0), K = x.size(1);
  const bool amx = g_bf16_amx && K % 32 == 0;
  if (!g_bf16_dot && !amx) return run_panels<Bf16Panels>(x, p, N, nullptr, bias);
  const std::vector<float> bias_f = bias_float(bias, N);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* B = bias_f.empty() ? nullptr : bias_f.data();
  const int64_t P = (N + kPanel - 1) / kPanel;
  if (amx) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      specdecode_kernels::bf16_amx_panels(X, M, K, p + p0 * K * kPanel, N, B, O, p0, p1, false);
    });
    return out;
  }
  const int64_t width = specdecode_kernels::bf16_dot_width(M);
  at::parallel_for(0, (P + width - 1) / width, 1, [&](int64_t u0, int64_t u1) {
    specdecode_kernels::bf16_dot_panels(X, M, K, p, N, B, O, u0 * width,
                                        std::min(P, u1 * width));
  });
  return out;
}

// Turn the AVX-512 F int8 tile on (where the CPU has it) or off; returns whether it is on now.
bool set_int8_avx512(bool on) {
  g_int8_avx512 = on && specdecode_kernels::int8_avx512_supported();
  return g_int8_avx512;
}

// Turn the AVX-512 VNNI int4 tile on (where the CPU has it) or off; returns whether it is on now.
bool set_int4_vnni(bool on) {
  g_int4_vnni = on && specdecode_kernels::int4_vnni_supported();
  return g_int4_vnni;
}

// Turn the AVX-512 BF16 path for bfloat16 panels on (where the CPU has it) or off; returns
// whether it is on now.
bool set_bf16_dot(bool on) {
  g_bf16_dot = on && specdecode_kernels::bf16_dot_supported();
  return g_bf16_dot;
}

// Turn AMX for bfloat16 panels on (where the CPU and OS allow it) or off; returns whether it is on
// now.
bool set_bf16_amx(bool on) {
  g_bf16_amx = on && specdecode_kernels::bf16_amx_supported();
  return g_bf16_amx;
}

// x: [M, K] bfloat16, panels: contiguous int8 holding ceil(N / 16) panels of [K][16] (rows past
// N zero), scale: [N] float32, bias: [N] or None -> [M, N] bfloat16, each sum scaled at its end.
torch::Tensor linear_int8_packed(torch::Tensor x, torch::Tensor panels, int64_t N,
                                 torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "linear_int8_packed: contiguous bfloat16 CPU x [M, K] expected");
  TORCH_CHECK(panels.scalar_type() == at::kChar && panels.is_contiguous() &&
                  panels.device().is_cpu(),
              "linear_int8_packed: contiguous int8 CPU panels expected");
  TORCH_CHECK(N >= 0 && panels.numel() == (N + kPanel - 1) / kPanel * kPanel * x.size(1),
              "linear_int8_packed: panels must hold ceil(N / 16) * 16 * K weights");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "linear_int8_packed: a contiguous float32 scale [N] expected");
  return run_panels<Int8Panels>(x, panels.data_ptr<int8_t>(), N, scale.data_ptr<float>(), bias);
}

// ---- int4 panels (4-bit weights, of a draft or a target) ----------------------------------
// Each row's weights in groups of 32 k: w = scale * q + min, q in 0..15 (asymmetric, one scale
// and one min per row and group: the grid of GGUF's Q4_K sub-blocks, which the presets were
// converted from). As in Q4_K, the scale and min are 8-bit codes times float16 steps shared by
// a block of groups: scale = d sc (sc uint8), min = dl ml (ml int8), d and dl per row and block
// of 2^shift groups (shift 3: Q4_K's 256 k, and `quantize_int4`'s; shift 0: one per group, Q4_0
// and Q4_1 files). Both products are exact in float32, so a Q4_K file's weights come out as
// the file has them. Activations are quantized too, per token and group of 32 k: x ~= dx * xq,
// xq in -127..127 (symmetric, dx = max |x| / 127), as llama.cpp does for its 4-bit formats.
// Then a group's x . q is an exact integer sum, and AVX2's byte multiply-add
// (vpmaddubsw: 32 unsigned x signed byte products summed in pairs, one instruction) does 32
// multiply-adds where float32 FMAs do 8, after a cheaper unpacking: about 3x fewer instructions
// per weight, which is what bounds a forward over more than one token.
//   out = sum over groups of (scale dx) (xq . q) + min (sum of x over the group)
// A panel holds 16 rows as K / 4 steps of 32 bytes: byte 4r + j of step s holds row r's weight
// at k = 4s + j (low nibble) and row r + 8's (high nibble), so one 32-byte load gives 8 rows x
// 4 k twice, and one broadcast of 4 activation bytes serves both. Codes are [P][K / 32][32]
// (per group: 16 rows' sc, then their ml), steps [P][blocks][32] float16 (16 rows' d, then dl):
// 4.625 bits per weight read in all with blocks of 8 groups, where float16 scales and mins per
// group made it 5 (a one-token forward is bound by those bytes). Tiles of 1-4 tokens x 16 rows (1-12
// on AVX-512 VNNI; more tokens: near-equal blocks). Each output's float32 sum runs over the
// groups in the same order whatever the tile, and a token's quantization depends on that token
// alone: batch invariant.
namespace {

using specdecode_kernels::int4_tile;
using specdecode_kernels::kInt4Group;

// A token's activations at 8 bits: xq [K] int8, per group g dx[g] and the exact sum of x.
struct QuantizedRows {
  std::vector<int8_t> xq;    // [M][K]
  std::vector<float> dx;     // [M][G]
  std::vector<float> xsum;   // [M][G]
};

// 8 bfloat16 -> 8 float32
inline __m256 bf16x8(const uint16_t* h) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// One group of 32 activations: xq = round(x 127 / max |x|) (as std::nearbyint: to nearest even),
// dx = max |x| / 127 and the sum of x (as four 8-lane partial sums, then lane_sum: one fixed
// order). A group with inf or NaN gets xq = 0 and an inf or NaN scale or sum: NaN outputs, as a
// float product would give, and no float-to-int conversion of a NaN.
inline void quantize_group(const uint16_t* src, int8_t* q, float* dx, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = bf16x8(src + 8 * i);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax);  // a NaN lane keeps amax
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float top = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const float inv = top > 0.f && std::isfinite(top) ? 127.f / top : 0.f;
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_mul_ps(v[i], scale);
    const __m256 ordered = _mm256_cmp_ps(r, r, _CMP_ORD_Q);  // NaN lanes -> 0
    n[i] = _mm256_cvtps_epi32(_mm256_and_ps(r, ordered));    // rounds to nearest even
  }
  const __m256i words = _mm256_packs_epi32(n[0], n[1]), words2 = _mm256_packs_epi32(n[2], n[3]);
  const __m256i bytes = _mm256_packs_epi16(words, words2);  // 128-bit lanes interleaved: undo
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  *dx = top / 127.f;
  *xsum = lane_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kInt4Group;
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  QuantizedRows r{std::vector<int8_t>(size_t(M * K)), std::vector<float>(size_t(M * G)),
                  std::vector<float>(size_t(M * G))};
  // groups are independent: threads only where there are enough of them to pay for waking up
  at::parallel_for(0, M * G, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // group i = token i / G, group i % G: at i * 32
      quantize_group(src + i * kInt4Group, r.xq.data() + i * kInt4Group, r.dx.data() + i,
                     r.xsum.data() + i);
  });
  return r;
}

}  // namespace

// A tile's results res [block][16] (tokens t0.., the `rows` rows of panel p) plus the bias, as
// bfloat16 into out [M][N].
namespace {
inline void store_tile(uint16_t* out, const float* res, const float* bias, int64_t t0,
                       int64_t block, int64_t p, int64_t rows, int64_t N) {
  for (int64_t t = 0; t < block; ++t)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = p * kPanel + i;
      out[(t0 + t) * N + n] = float_to_bf16(res[t * kPanel + i] + (bias ? bias[n] : 0.f));
    }
}
}  // namespace

namespace {

// One 4-bit or 6-bit linear over the 8-bit activations of x, checked, its output made:
// `panel(p, res)` computes panel p's rows for every token. A linear runs all its panels
// (`run`); `linear_group` runs the panels of several linears over the same x in one parallel
// region. A panel's outputs are the same bits whichever call or thread computes them.
struct QuantizedJob {
  bool q6;
  int64_t M, K, N, G, P;
  int sh;  // int4: log2 of the groups per block of steps
  const uint8_t* w0;   // int4: panels; q6: lo
  const uint8_t* w1;   // int4: codes; q6: hi
  const void* w2;      // int4: steps (float16); q6: sc (int8)
  const uint16_t* w3;  // q6: d (float16)
  const QuantizedRows* xr;
  const int32_t* xs;  // q6: per group the halves' sums of xq, packed
  std::vector<float> bias_f;
  torch::Tensor out;
  uint16_t* op;

  void panel(int64_t p, float* res) const {
    const int64_t rows = std::min<int64_t>(kPanel, N - p * kPanel);
    const int64_t most = !g_int4_vnni ? 4
                         : q6        ? specdecode_kernels::q6_vnni_tile_rows()
                                     : specdecode_kernels::int4_vnni_tile_rows();
    const int64_t blocks = (M + most - 1) / most;  // as few blocks as possible, near-equal
    const float* bp = bias_f.empty() ? nullptr : bias_f.data();
    for (int64_t b = 0, t0 = 0; b < blocks; ++b) {
      const int64_t block = (M - t0) / (blocks - b);
      const int8_t* xt = xr->xq.data() + t0 * K;
      const float* dt = xr->dx.data() + t0 * G;
      if (q6) {
        const uint8_t* pl = w0 + p * kPanel * K / 2;
        const uint8_t* ph = w1 + p * kPanel * K / 4;
        const int8_t* ps = static_cast<const int8_t*>(w2) + p * kPanel * K / 16;
        const uint16_t* pd = w3 + p * kPanel * K / specdecode_kernels::kQ6Block;
        const int32_t* st = xs + t0 * G;
        if (g_int4_vnni) {
          specdecode_kernels::q6_vnni_tile(block, pl, ph, ps, pd, K, xt, st, dt, res);
        } else {
          with_tile_rows<4>(block, [&](auto n) {
            specdecode_kernels::q6_tile<decltype(n)::value>(pl, ph, ps, pd, K, xt, st, dt, res);
          });
        }
      } else {
        const int64_t B = (G + (int64_t(1) << sh) - 1) >> sh;
        const uint8_t* panel = w0 + p * (K / 2) * kPanel;
        const uint8_t* c = w1 + p * G * 2 * kPanel;
        const uint16_t* s = static_cast<const uint16_t*>(w2) + p * B * 2 * kPanel;
        const float* st = xr->xsum.data() + t0 * G;
        if (g_int4_vnni) {
          specdecode_kernels::int4_vnni_tile(block, panel, c, s, sh, K, xt, dt, st, res);
        } else {
          with_tile_rows<4>(block, [&](auto n) {
            int4_tile<decltype(n)::value>(panel, c, s, sh, K, xt, dt, st, res);
          });
        }
      }
      store_tile(op, res, bp, t0, block, p, rows, N);
      t0 += block;
    }
  }

  torch::Tensor run() const {
    if (M > 0 && N > 0)
      at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
        float res[12 * kPanel];
        for (int64_t p = p0; p < p1; ++p) panel(p, res);
      });
    return out;
  }
};

void check_activations(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.device().is_cpu(),
              what, ": contiguous bfloat16 CPU x [M, K] expected");
}

// x [M, K] (checked by the caller), its 8-bit activations xr -> the 4-bit linear's job
QuantizedJob int4_job(const torch::Tensor& x, const QuantizedRows& xr, const torch::Tensor& panels,
                      int64_t N, const torch::Tensor& codes, const torch::Tensor& steps,
                      int64_t shift, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kInt4Group == 0, "linear_int4_packed: K must be a multiple of 32");
  const int64_t P = (N + kPanel - 1) / kPanel, G = K / kInt4Group;
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                  panels.device().is_cpu() && N >= 0 && panels.numel() == P * kPanel * K / 2,
              "linear_int4_packed: contiguous uint8 panels of ceil(N / 16) * 16 * K / 2 bytes");
  TORCH_CHECK(shift >= 0 && shift <= 8, "linear_int4_packed: shift must be in 0..8");
  const int64_t B = (G + (int64_t(1) << shift) - 1) >> shift;  // blocks of groups per row
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.device().is_cpu() && codes.numel() == P * G * 2 * kPanel,
              "linear_int4_packed: contiguous uint8 codes [P][K / 32][32]");
  TORCH_CHECK(steps.scalar_type() == at::kHalf && steps.is_contiguous() &&
                  steps.device().is_cpu() && steps.numel() == P * B * 2 * kPanel,
              "linear_int4_packed: contiguous float16 steps [P][ceil(K / 32 / 2^shift)][32]");
  auto out = torch::empty({M, N}, x.options());
  return {false, M, K, N, G, P, static_cast<int>(shift), panels.data_ptr<uint8_t>(),
          codes.data_ptr<uint8_t>(), steps.data_ptr<at::Half>(), nullptr, &xr, nullptr,
          bias_float(bias, N), out, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())};
}

// Per group of 32 activations, the sums of xq over its two halves of 16, packed in one int32
std::vector<int32_t> half_sums(const QuantizedRows& xr, int64_t M, int64_t G) {
  std::vector<int32_t> xs(size_t(M * G));
  for (int64_t i = 0; i < M * G; ++i) {
    int32_t a = 0, b = 0;
    for (int j = 0; j < 16; ++j) {
      a += xr.xq[i * kInt4Group + j];
      b += xr.xq[i * kInt4Group + 16 + j];
    }
    xs[i] = int32_t((uint32_t(a) & 0xFFFF) | (uint32_t(b) << 16));
  }
  return xs;
}

// x [M, K] (checked by the caller), its 8-bit activations xr and their half_sums xs -> the
// 6-bit linear's job
QuantizedJob q6_job(const torch::Tensor& x, const QuantizedRows& xr, const std::vector<int32_t>& xs,
                    const torch::Tensor& lo, const torch::Tensor& hi, const torch::Tensor& sc,
                    const torch::Tensor& d, int64_t N, const c10::optional<torch::Tensor>& bias) {
  using specdecode_kernels::kQ6Block;
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kQ6Block == 0, "linear_q6_packed: K must be a multiple of 256");
  const int64_t P = (N + kPanel - 1) / kPanel, G = K / kInt4Group;
  const auto bytes_ok = [&](const torch::Tensor& t, at::ScalarType type, int64_t numel) {
    return t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu() &&
           t.numel() == numel;
  };
  TORCH_CHECK(N >= 0 && bytes_ok(lo, at::kByte, P * kPanel * K / 2) &&
                  bytes_ok(hi, at::kByte, P * kPanel * K / 4) &&
                  bytes_ok(sc, at::kChar, P * kPanel * K / 16) &&
                  bytes_ok(d, at::kHalf, P * kPanel * K / kQ6Block),
              "linear_q6_packed: contiguous panels expected: lo uint8 [P][K / 4][32], hi uint8 "
              "[P][K / 8][32], sc int8 [P][K / 16][16], d float16 [P][K / 256][16]");
  auto out = torch::empty({M, N}, x.options());
  return {true, M, K, N, G, P, 0, lo.data_ptr<uint8_t>(), hi.data_ptr<uint8_t>(),
          sc.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), &xr,
          xs.data(), bias_float(bias, N), out,
          reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())};
}

}  // namespace

// A prefill's 4-bit or 6-bit linear on AMX bfloat16 tiles (linear_amx.cpp, "4-bit and 6-bit
// panels as bfloat16 panels"): per pair of panels, unpacked to bfloat16 once (`unpack(p, out)`)
// and run over every token. Not the tiles' bits (bfloat16 activations, weights rounded to bfloat16): for
// prefills past VERIFY_TOKENS rows only, where the caller chose it (cpu_linear.prefill_linear).
template <class Unpack>
torch::Tensor prefill_on_amx(const torch::Tensor& x, const QuantizedJob& job, Unpack unpack) {
  TORCH_CHECK(specdecode_kernels::bf16_amx_supported(),
              "a prefill's quantized product on AMX needs AMX bfloat16 tiles (none here)");
  const int64_t M = job.M, K = job.K, N = job.N, P = job.P;
  // past 32 rows the tiles go in passes of 32: pad the rows once here, not per panel pair, and
  // pack each 16 rows' tiles into 1 KB pieces ([rows/16][K/32][16][32]: x is read once per pair
  // of panels, each tile in one piece rather than 16 rows K apart)
  const int64_t rows = M > 32 ? (M + 31) / 32 * 32 : M;
  const bool packed = rows > 32;
  torch::Tensor xp = x;
  if (rows != M) {
    xp = torch::zeros({rows, K}, x.options());
    xp.narrow(0, 0, M).copy_(x);
  }
  if (packed) xp = xp.view({rows / 16, 16, K / 32, 32}).permute({0, 2, 1, 3}).contiguous();
  auto out = torch::empty({rows, N}, x.options());
  const auto* X = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* B = job.bias_f.empty() ? nullptr : job.bias_f.data();
  if (M > 0 && N > 0)
    at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<uint16_t> pair;  // two bfloat16 panels [K/2][16][2]
      pair.resize(size_t(2 * K * kPanel));
      for (int64_t p = 2 * i0; p < std::min(2 * i1, P); p += 2) {
        const int64_t end = std::min(p + 2, P);
        for (int64_t q = p; q < end; ++q) unpack(q, pair.data() + (q - p) * K * kPanel);
        specdecode_kernels::bf16_amx_panels(X, rows, K, pair.data(), N, B, O, p, end, packed);
      }
    });
  return rows == M ? out : out.narrow(0, 0, M).contiguous();
}

torch::Tensor linear_int4_prefill(torch::Tensor x, torch::Tensor panels, int64_t N,
                                  torch::Tensor codes, torch::Tensor steps, int64_t shift,
                                  c10::optional<torch::Tensor> bias) {
  check_activations(x, "linear_int4_prefill");
  const QuantizedRows none{};
  const QuantizedJob job = int4_job(x, none, panels, N, codes, steps, shift, bias);
  const int64_t K = job.K, G = job.G, blocks = (G + (int64_t(1) << job.sh) - 1) >> job.sh;
  return prefill_on_amx(x, job, [&](int64_t p, uint16_t* out) {
    specdecode_kernels::int4_bf16_panel(
        job.w0 + p * (K / 2) * kPanel, job.w1 + p * G * 2 * kPanel,
        static_cast<const uint16_t*>(job.w2) + p * blocks * 2 * kPanel, job.sh, K, out);
  });
}

torch::Tensor linear_q6_prefill(torch::Tensor x, torch::Tensor lo, torch::Tensor hi,
                                torch::Tensor sc, torch::Tensor d, int64_t N,
                                c10::optional<torch::Tensor> bias) {
  check_activations(x, "linear_q6_prefill");
  const QuantizedRows none{};
  const std::vector<int32_t> no_sums;
  const QuantizedJob job = q6_job(x, none, no_sums, lo, hi, sc, d, N, bias);
  const int64_t K = job.K;
  return prefill_on_amx(x, job, [&](int64_t p, uint16_t* out) {
    specdecode_kernels::q6_bf16_panel(
        job.w0 + p * kPanel * K / 2, job.w1 + p * kPanel * K / 4,
        static_cast<const int8_t*>(job.w2) + p * kPanel * K / 16,
        job.w3 + p * kPanel * K / specdecode_kernels::kQ6Block, K, out);
  });
}

// x: [M, K] bfloat16 (K a multiple of 32), panels: uint8 [P = ceil(N / 16)][K / 4][32] (see
// above; rows past N zero), codes: uint8 [P][K / 32][32], steps: float16
// [P][ceil(K / 32 / 2^shift)][32], bias: [N] or None -> [M, N] bfloat16 with out[m, n] =
// sum_k xq[m, k] dx (scale q + min) + bias[n], the min term on the exact sum of x.
torch::Tensor linear_int4_packed(torch::Tensor x, torch::Tensor panels, int64_t N,
                                 torch::Tensor codes, torch::Tensor steps, int64_t shift,
                                 c10::optional<torch::Tensor> bias) {
  check_activations(x, "linear_int4_packed");
  const QuantizedRows xr = quantize_rows(x);
  return int4_job(x, xr, panels, N, codes, steps, shift, bias).run();
}

// 6-bit panels: GGUF Q6_K's grid as the file has it (a GGUF-made target's Q6_K tensors: its
// output layer, half its down and value projections), instead of int8 per row: 6.56 bits per
// weight read, not 8, and the file's own weights, not a second rounding of them. Same 8-bit
// activations as the int4 panels (groups of 32); the tile (q6_tile.h) sums each group exactly
// in integers and adds (d dx) times it, group after group: batch invariant as they are.
//   out = sum over groups of d dx (sum over its 16-k halves of sc (xq . q - 32 sum xq))
torch::Tensor linear_q6_packed(torch::Tensor x, torch::Tensor lo, torch::Tensor hi,
                               torch::Tensor sc, torch::Tensor d, int64_t N,
                               c10::optional<torch::Tensor> bias) {
  check_activations(x, "linear_q6_packed");
  const QuantizedRows xr = quantize_rows(x);
  const std::vector<int32_t> xs = half_sums(xr, x.size(0), x.size(1) / kInt4Group);
  return q6_job(x, xr, xs, lo, hi, sc, d, N, bias).run();
}

// Several 4-bit and 6-bit linears of the same x (a layer's q, k and v projections; its gate and
// up): x quantized once, every panel of every linear in one parallel region (one wake-up and
// one wait of the threads, not one per linear). Each output is the same bits as its own call's.
std::vector<torch::Tensor> linear_group(const torch::Tensor& x,
                                        const std::vector<QuantizedCall>& calls) {
  check_activations(x, "linear_group");
  const QuantizedRows xr = quantize_rows(x);
  std::vector<int32_t> xs;
  std::vector<QuantizedJob> jobs;
  std::vector<int64_t> first{0};  // job j's panels are first[j]..first[j + 1]
  for (const QuantizedCall& c : calls) {
    const std::vector<torch::Tensor>& w = *c.weights;
    if (c.q6 && xs.empty()) xs = half_sums(xr, x.size(0), x.size(1) / kInt4Group);
    jobs.push_back(c.q6 ? q6_job(x, xr, xs, w[0], w[1], w[2], w[3], c.n, *c.bias)
                        : int4_job(x, xr, w[0], c.n, w[1], w[2], c.shift, *c.bias));
    first.push_back(first.back() + (x.size(0) > 0 ? jobs.back().P : 0));
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t i0, int64_t i1) {
    float res[12 * kPanel];
    size_t j = std::upper_bound(first.begin(), first.end(), i0) - first.begin() - 1;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= first[j + 1]) ++j;
      jobs[j].panel(i - first[j], res);
    }
  });
  std::vector<torch::Tensor> outs;
  for (const QuantizedJob& job : jobs) outs.push_back(job.out);
  return outs;
}

// lean_layers.cpp: LinearOp, LeanLayer, LeanLayers
void bind_lean_layers(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_lean_layers(m);
  m.def("linear", &linear, "bfloat16 linear for few tokens (AVX2 + FMA), batch invariant");
  m.def("linear_packed", &linear_packed,
        "bfloat16 linear on weights packed in 16-row panels (AVX2 + FMA), batch invariant");
  m.def("set_bf16_amx", &set_bf16_amx,
        "run bfloat16 panels with K a multiple of 32 on AMX tiles where the CPU has them "
        "(default) or not; returns whether it is on");
  m.def(
      "bf16_amx_on", [] { return g_bf16_amx; }, "whether bfloat16 panels run on AMX tiles");
  m.def("set_bf16_dot", &set_bf16_dot,
        "bfloat16 panels on AVX-512 BF16 (where the CPU has it) or on AVX2 FMAs; returns which");
  m.def("set_int8_avx512", &set_int8_avx512,
        "the int8 tile on AVX-512 F (where the CPU has it; same results) or on AVX2");
  m.def("set_int4_vnni", &set_int4_vnni,
        "the int4 and 6-bit tiles on AVX-512 VNNI (where the CPU has it; same results) or on "
        "AVX2");
  m.def(
      "bf16_dot_on", [] { return g_bf16_dot; }, "whether bfloat16 panels run on AVX-512 BF16");
  m.def("bf16_dot_prefetch", &specdecode_kernels::bf16_dot_prefetch,
        "the AVX-512 BF16 panels' prefetch distance in elements: set it (> 0), get it (0)");
  m.def("linear_int8_packed", &linear_int8_packed,
        "int8-weight linear on 16-row panels (one scale per row), batch invariant");
  m.def("linear_int4_packed", &linear_int4_packed,
        "int4-weight linear on 16-row panels (a coded scale and min per row and 32 k), batch "
        "invariant");
  m.def("linear_int4_prefill", &linear_int4_prefill,
        "int4-weight linear for a prefill's many rows on AMX bfloat16 tiles (weights unpacked "
        "to bfloat16 per pair of panels; not the int4 tile's bits)");
  m.def("linear_q6_prefill", &linear_q6_prefill,
        "6-bit linear for a prefill's many rows on AMX bfloat16 tiles (as linear_int4_prefill)");
  m.def("bf16_amx_supported", &specdecode_kernels::bf16_amx_supported,
        "whether this CPU and OS run AMX bfloat16 tiles");
  m.def("linear_q6_packed", &linear_q6_packed,
        "linear on 6-bit panels (GGUF Q6_K's grid) and 8-bit activations, batch invariant");
  m.def("add_rms_norm", &add_rms_norm, "residual sum and RMSNorm of a few bfloat16 rows");
  m.def("add_rms_norm_f32", &add_rms_norm_f32,
        "residual sum (float32) and RMSNorm (to bfloat16) of a few rows");
  m.def("rope_attention", &rope_attention,
        "rotary embedding, cache write and attention of a few new tokens (float32 cache)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a few bfloat16 rows, rounded as PyTorch does");
  m.def("argmax_rows", &argmax_rows,
        "argmax over the last dimension of [R, V] bfloat16 or float32 logits, as torch.argmax");
}
