// Linear-layer paths for CPUs with AVX-512, called from linear_avx2.cpp where the CPU has the
// instructions: the bfloat16 panels on AVX-512 BF16, and the int4 panel tile on AVX-512 VNNI.
//
// bfloat16 panels (AMD Zen 4/5, Intel Cooper Lake and later): one `vdpbf16ps` multiplies 16
// rows' weights at a pair of k (one 64-byte line of a panel, whose layout [K/2][16][2] is exactly
// that instruction's operand) by a token's two activations and adds both products to 16 float32
// sums: 32 multiply-adds per instruction, against 8 per FMA on the AVX2 path, with no widening of
// the weights. So verifying a dozen tokens stays bound by reading the weights rather than by
// arithmetic.
//
// Batch invariance, as on the AVX2 path: each output is one float32 chain over the pairs of k
// in order (each step adds the odd k's product, then the even k's, rounded to nearest even,
// denormals flushed: the instruction's definition), whatever the number of tokens in the call
// or the tile that computes it. The chain differs from the AVX2 path's FMA chain (even k first,
// no flush), so the two paths round differently: a process uses one of them for every forward.
//
// int4 panels (int4_tile.h, built here with SD_INT4_VNNI): `vpdpbusd` adds 4 byte products
// straight into a 32-bit lane, where AVX2 needs vpmaddubsw, a 16-bit add and a vpmaddwd: about
// half the instructions per weight and token, and the same exact integer sums, so the results
// are bit-identical to the AVX2 build's.
//
// This file holds only functions compiled for AVX-512 (target attributes and one target pragma
// region) and includes no PyTorch header, so no inline function shared with the AVX2 file is
// ever compiled with AVX-512 instructions; linear_avx2.cpp calls in only after a CPU check.
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "kernel_common.h"

namespace specdecode_kernels {

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel

// How far ahead within a panel the tile prefetches, in elements: 2048, 4 KB (bf16_dot_prefetch
// sets it). Over a dozen tokens the tile is nearly as busy multiplying as reading, and 16 KB
// ahead (the AVX2 path's distance) hid less of the reading: the 1.5B target's layers, out of
// cache, took longer over 12 tokens at 16 KB than at 4 KB, with 2 and 8 KB in between
// (benchmarks/kernel_rate.py; docs/lab-notes/2026-12-01-leaf-and-prefetch.md).
std::atomic<int64_t> g_prefetch{2048};  // set from Python, read by every worker's tile

#define SD_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define SD_UNROLL _Pragma("GCC unroll 16")

// res[(t * V + v) * 16 + i] = dot(row i of panel v, x[t]) for MR tokens x V panels:
// MR x V accumulators, V weight lines and one broadcast pair per step (at most 12 x 2 + 2 + 1
// of the 32 vector registers).
template <int MR, int V>
SD_TARGET inline void tile(const uint16_t* p, int64_t K, int64_t pstride, const uint16_t* x,
                           float* res) {
  const int64_t ahead = g_prefetch.load(std::memory_order_relaxed);
  __m512 acc[MR][V];
  SD_UNROLL for (int t = 0; t < MR; ++t)
    SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / 2; ++j) {
    __m512bh w[V];
    SD_UNROLL for (int v = 0; v < V; ++v) {
      const uint16_t* q = p + v * pstride + j * 32;
      _mm_prefetch(reinterpret_cast<const char*>(q + ahead), _MM_HINT_T0);
      w[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q));
    }
    SD_UNROLL for (int t = 0; t < MR; ++t) {
      int32_t pair;  // x[t, 2j] in the low half, x[t, 2j + 1] in the high half, as the weights
      std::memcpy(&pair, x + t * K + 2 * j, 4);
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], w[v], xb);
    }
  }
  SD_UNROLL for (int t = 0; t < MR; ++t)
    SD_UNROLL for (int v = 0; v < V; ++v) _mm512_storeu_ps(res + (t * V + v) * 16, acc[t][v]);
}

struct Dest {  // out[m, n] = bf16(sum + bias[n]) for m < M, n < N
  const float* bias;  // [N] or nullptr
  uint16_t* out;      // [M, N]
  int64_t M, N;
};

// tokens m0 .. m0+MR against panels p .. p+V (first output n0), written where n < N
template <int MR, int V>
SD_TARGET void block(const uint16_t* p, int64_t K, int64_t pstride, const uint16_t* x, int64_t m0,
                     int64_t n0, const Dest& d) {
  float res[MR * V * kPanel];
  tile<MR, V>(p, K, pstride, x + m0 * K, res);
  const int64_t rows = d.N - n0 < V * kPanel ? d.N - n0 : V * kPanel;
  for (int t = 0; t < MR; ++t)
    for (int64_t i = 0; i < rows; ++i) {
      const float sum = res[t * V * kPanel + i] + (d.bias ? d.bias[n0 + i] : 0.f);
      d.out[(m0 + t) * d.N + n0 + i] = float_to_bf16(sum);
    }
}

// All M tokens against V panels: one tile for one or two tokens (V = 4 there: enough chains in
// flight for a call bound by reading the weights), else near-equal blocks of 3-12 tokens.
template <int V>
SD_TARGET void panels_tokens(const uint16_t* p, int64_t K, int64_t pstride, const uint16_t* x,
                             int64_t M, int64_t n0, const Dest& d) {
  if (M <= 2) {
    M == 1 ? block<1, V>(p, K, pstride, x, 0, n0, d) : block<2, V>(p, K, pstride, x, 0, n0, d);
    return;
  }
  if constexpr (V <= 2) {
    const int64_t blocks = (M + 11) / 12;
    int64_t m = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t mr = (M - m) / (blocks - b);
      switch (mr) {
        case 12: block<12, V>(p, K, pstride, x, m, n0, d); break;
        case 11: block<11, V>(p, K, pstride, x, m, n0, d); break;
        case 10: block<10, V>(p, K, pstride, x, m, n0, d); break;
        case 9: block<9, V>(p, K, pstride, x, m, n0, d); break;
        case 8: block<8, V>(p, K, pstride, x, m, n0, d); break;
        case 7: block<7, V>(p, K, pstride, x, m, n0, d); break;
        case 6: block<6, V>(p, K, pstride, x, m, n0, d); break;
        case 5: block<5, V>(p, K, pstride, x, m, n0, d); break;
        case 4: block<4, V>(p, K, pstride, x, m, n0, d); break;
        default: block<3, V>(p, K, pstride, x, m, n0, d); break;
      }
      m += mr;
    }
  }
}

}  // namespace

bool bf16_dot_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

int64_t bf16_dot_width(int64_t M) { return M <= 2 ? 4 : 2; }

int64_t bf16_dot_prefetch(int64_t elements) {
  if (elements > 0) g_prefetch.store(elements, std::memory_order_relaxed);
  return g_prefetch.load(std::memory_order_relaxed);
}

SD_TARGET void bf16_dot_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels,
                               int64_t N, const float* bias, uint16_t* out, int64_t p0,
                               int64_t p1) {
  const int64_t pstride = K * kPanel;
  const Dest d{bias, out, M, N};
  int64_t p = p0;  // groups of 4 panels (1-2 tokens only), then of 2, then single panels
  if (bf16_dot_width(M) == 4)
    for (; p + 4 <= p1; p += 4)
      panels_tokens<4>(panels + p * pstride, K, pstride, x, M, p * kPanel, d);
  for (; p + 2 <= p1; p += 2)
    panels_tokens<2>(panels + p * pstride, K, pstride, x, M, p * kPanel, d);
  for (; p < p1; ++p) panels_tokens<1>(panels + p * pstride, K, pstride, x, M, p * kPanel, d);
}

bool int4_vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

}  // namespace specdecode_kernels

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define SD_INT4_VNNI 1
#include "int4_tile.h"

namespace specdecode_kernels {

// int4_tile<mr> (1 <= mr <= 4) on AVX-512 VNNI: the arguments of int4_tile
void int4_vnni_tile(int64_t mr, const uint8_t* p, const uint16_t* sc, const uint16_t* mn,
                    int64_t K, const int8_t* xq, const float* dx, const float* xsum, float* res) {
  switch (mr) {
    case 4: int4_tile<4>(p, sc, mn, K, xq, dx, xsum, res); break;
    case 3: int4_tile<3>(p, sc, mn, K, xq, dx, xsum, res); break;
    case 2: int4_tile<2>(p, sc, mn, K, xq, dx, xsum, res); break;
    default: int4_tile<1>(p, sc, mn, K, xq, dx, xsum, res); break;
  }
}

}  // namespace specdecode_kernels
#pragma GCC pop_options
