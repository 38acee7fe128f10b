// Linear-layer paths for CPUs with AVX-512, called from linear_avx2.cpp where the CPU has the
// instructions: the bfloat16 panels on AVX-512 BF16, the int4 and 6-bit panel tiles on AVX-512
// VNNI and the int8 panel tile on AVX-512 F.
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
// int4 panels on AVX-512 VNNI (`int4_tile512`): `vpdpbusd` adds 4 byte products straight into
// a 32-bit lane, where AVX2 needs vpmaddubsw, a 16-bit add and a vpmaddwd, on 512-bit vectors
// (16 rows x 8 k per instruction): about a third of the AVX2 tile's instructions per weight
// and token, and the same exact integer sums, so the results are bit-identical to AVX2's.
//
// This file holds only functions compiled for AVX-512 (target attributes) and includes no
// PyTorch header, so no inline function shared with the AVX2 file is ever compiled with
// AVX-512 instructions; linear_avx2.cpp calls in only after a CPU check.
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "int4_codes512.h"
#include "kernel_common.h"

namespace specdecode_kernels {

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel

// How far ahead within a panel the tile prefetches, in elements: 2048, 4 KB (bf16_dot_prefetch
// sets it). Over a dozen tokens the tile is nearly as busy multiplying as reading, and 16 KB
// ahead (the AVX2 path's distance) hid less of the reading: the 1.5B target's layers, out of
// cache, took longer over 12 tokens at 16 KB than at 4 KB, with 2 and 8 KB in between
// (benchmarks/kernel_rate.py; docs/results.md).
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

namespace {

#define SD_AVX512F __attribute__((target("avx512f")))

constexpr int64_t kInt8Prefetch = 4096;  // bytes ahead within a panel

// The int8 panel tile (Int8Panels in linear_avx2.cpp: a panel's line k holds its 16 rows'
// weights at k) on 512-bit vectors: one line widened to 16 float32 lanes, one FMA per token,
// where AVX2 takes two of each. Every output is the same float32 FMA chain over k in order as
// on AVX2, so the results are bit-identical (tested). MR tokens x V panels.
template <int MR, int V>
SD_AVX512F inline void int8_step512(const int8_t* p, int64_t K, int64_t pstride, const float* x,
                                    int64_t k, __m512 (&acc)[MR][V]) {
  __m512 w[V];
  SD_UNROLL for (int v = 0; v < V; ++v) {
    const int8_t* q = p + v * pstride + k * 16;
    const __m128i line = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(line));
  }
  SD_UNROLL for (int t = 0; t < MR; ++t) {
    const __m512 xk = _mm512_set1_ps(x[t * K + k]);
    SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm512_fmadd_ps(w[v], xk, acc[t][v]);
  }
}

template <int MR, int V>
SD_AVX512F void int8_tile512(const int8_t* p, int64_t K, int64_t pstride, const float* x,
                             float* res) {
  __m512 acc[MR][V];
  SD_UNROLL for (int t = 0; t < MR; ++t)
    SD_UNROLL for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {  // four k per iteration: one 64-byte line per panel
    SD_UNROLL for (int v = 0; v < V; ++v)
      _mm_prefetch(reinterpret_cast<const char*>(p + v * pstride + k * 16 + kInt8Prefetch),
                   _MM_HINT_T0);
    SD_UNROLL for (int u = 0; u < 4; ++u) int8_step512<MR, V>(p, K, pstride, x, k + u, acc);
  }
  for (; k < K; ++k) int8_step512<MR, V>(p, K, pstride, x, k, acc);
  SD_UNROLL for (int t = 0; t < MR; ++t)
    SD_UNROLL for (int v = 0; v < V; ++v) _mm512_storeu_ps(res + (t * V + v) * 16, acc[t][v]);
}

}  // namespace

bool int8_avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// Int8Panels::tile<mr, 2 * panels> of linear_avx2.cpp (the same arguments and res layout) on
// AVX-512 F: mr 1-2 with 1-2 panels, or 4-6 with one
SD_AVX512F void int8_avx512_tile(int64_t mr, int64_t panels, const int8_t* p, int64_t K,
                                 int64_t pstride, const float* x, float* res) {
  if (panels == 2) {
    mr == 1 ? int8_tile512<1, 2>(p, K, pstride, x, res) : int8_tile512<2, 2>(p, K, pstride, x, res);
    return;
  }
  switch (mr) {
    case 1: int8_tile512<1, 1>(p, K, pstride, x, res); break;
    case 2: int8_tile512<2, 1>(p, K, pstride, x, res); break;
    case 4: int8_tile512<4, 1>(p, K, pstride, x, res); break;
    case 5: int8_tile512<5, 1>(p, K, pstride, x, res); break;
    default: int8_tile512<6, 1>(p, K, pstride, x, res); break;
  }
}

bool int4_vnni_supported() {  // the int4 and 6-bit tiles use AVX-512 BW instructions too
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

namespace {

#define SD_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// The int4 panel tile (layout: "int4 panels" in linear_avx2.cpp) on 512-bit VNNI: MR tokens x 16
// rows, every `vpdpbusd` lane one row (int4_tile512 below). Its group sums are the exact
// integers the AVX2 tile's are, and the group's scale and min are applied as there, in the same
// order and rounding per output: the results are bit-identical to the AVX2 tile's (tested).
// Each of MR tokens' activations k at .. at + 3 and at + 4 .. at + 7 (xq + t K), broadcast,
// times rows 0-15 at those k (first, second): acc[t] += two `vpdpbusd`, row i's sum in lane i
// (the int4 and 6-bit tiles' inner step).
template <int MR>
SD_VNNI512 inline void dot8_rows(__m512i (&acc)[MR], __m512i first, __m512i second,
                                 const int8_t* xq, int64_t K, int64_t at) {
  SD_UNROLL for (int t = 0; t < MR; ++t) {
    int32_t a, b;
    std::memcpy(&a, xq + t * K + at, 4);
    std::memcpy(&b, xq + t * K + at + 4, 4);
    acc[t] = _mm512_dpbusd_epi32(acc[t], first, _mm512_set1_epi32(a));
    acc[t] = _mm512_dpbusd_epi32(acc[t], second, _mm512_set1_epi32(b));
  }
}

// Per 64-byte load (two of the layout's 32-byte steps), the two unpacked halves
// (rows 0-7 and 8-15, each k 8q .. 8q + 3 in its low 256 bits and 8q + 4 .. 8q + 7 in its high)
// are regrouped by two 128-bit-lane shuffles, shared by every token, into rows 0-15 at k 8q ..
// 8q + 3 and rows 0-15 at k 8q + 4 .. 8q + 7. Each token then pays two 4-byte broadcasts (loads)
// and two `vpdpbusd`, and its group sum is already in lane i at the group's end: no permutes or
// add per token and group, one accumulator per token instead of two, so up to 12 tokens fit the
// 32 registers and a 12-row verification unpacks each weight once. (An earlier tile kept lanes
// 2i and 2i + 1 for row i, one 8-byte broadcast per load, and paid two permutes and an add per
// token and group to bring the sums together: slower at every shape and row count measured,
// docs/results.md.)
template <int MR>
SD_VNNI512 void int4_tile512(const uint8_t* p, const uint8_t* codes, const uint16_t* steps,
                             int shift, int64_t K, const int8_t* xq, const float* dx,
                             const float* xsum, float* res) {
  const int64_t G = K / 32;
  const __m512i low = _mm512_set1_epi8(0xF);
  __m512 total[MR];
  SD_UNROLL for (int t = 0; t < MR; ++t) total[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[MR];
    SD_UNROLL for (int t = 0; t < MR; ++t) acc[t] = _mm512_setzero_si512();
    const uint8_t* pg = p + g * 256;  // 16 rows x 32 k at 4 bits
    SD_UNROLL for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(pg + 4096 + 64 * line), _MM_HINT_T0);
    SD_UNROLL for (int q = 0; q < 4; ++q) {
      const __m512i raw = _mm512_loadu_si512(pg + 64 * q);
      const __m512i w0 = _mm512_and_si512(raw, low);                         // rows 0-7
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);  // rows 8-15
      const __m512i first = _mm512_shuffle_i64x2(w0, w1, 0x44);   // rows 0-15, k 8q .. 8q + 3
      const __m512i second = _mm512_shuffle_i64x2(w0, w1, 0xEE);  // rows 0-15, k 8q + 4 .. 8q + 7
      dot8_rows<MR>(acc, first, second, xq, K, g * 32 + 8 * q);
    }
    const uint8_t* cg = codes + g * 32;            // sc [16] uint8, then ml [16] int8
    const uint16_t* sg = steps + (g >> shift) * 32;  // d [16], then dl [16] float16
    const __m512 s = coded16(cg, sg, false), m = coded16(cg + 16, sg + 16, true);
    SD_UNROLL for (int t = 0; t < MR; ++t) {
      const __m512 sdx = _mm512_mul_ps(s, _mm512_set1_ps(dx[t * G + g]));
      total[t] = _mm512_fmadd_ps(sdx, _mm512_cvtepi32_ps(acc[t]), total[t]);
      total[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[t * G + g]), total[t]);
    }
  }
  SD_UNROLL for (int t = 0; t < MR; ++t) _mm512_storeu_ps(res + t * 16, total[t]);
}

}  // namespace

int64_t int4_vnni_tile_rows() { return 12; }

// int4_tile512<mr> (1 <= mr <= int4_vnni_tile_rows()): the arguments of int4_tile
SD_VNNI512 void int4_vnni_tile(int64_t mr, const uint8_t* p, const uint8_t* codes,
                               const uint16_t* steps, int shift, int64_t K, const int8_t* xq,
                               const float* dx, const float* xsum, float* res) {
  with_tile_rows<12>(mr, [&](auto n) {
    int4_tile512<decltype(n)::value>(p, codes, steps, shift, K, xq, dx, xsum, res);
  });
}

namespace {

// The 6-bit panel tile (q6_tile.h has the layout and the AVX2 build) on 512-bit VNNI: MR tokens
// x 16 rows, every `vpdpbusd` lane one row, as int4_tile512. Per group of 32 k, four 64-byte
// loads of the low 4 bits, each regrouped as there (two 128-bit-lane shuffles) into rows 0-15
// at k 8q .. 8q + 3 and rows 0-15 at 8q + 4 .. 8q + 7, and one 32-byte load of the top 2 bits
// (lane r: rows r and r + 8, byte j: bits 0-1 row r at k 8q + j, 2-3 row r + 8, 4-5 row r at
// 8q + 4 + j, 6-7 row r + 8), copied to both halves of a register; a rotation per lane brings
// each row's 2 bits to bits 4-5 of every byte. All shared by the tokens; each token then pays
// two 4-byte broadcasts (loads) and two `vpdpbusd` per load, and after each half of 16 k its
// row sums, already in their lanes, times that half's sc. The group's sum minus
// 32 (sc_a xs_a + sc_b xs_b) is the AVX2 tile's exact int32, and (d dx) times it is added to
// the totals in the same order and rounding: the results are bit-identical to q6_tile's
// (tested). Two registers per token (its half's sums and its group's), so tiles of up to 12.
template <int MR>
SD_VNNI512 void q6_tile512(const uint8_t* lo, const uint8_t* hi, const int8_t* sc,
                           const uint16_t* d, int64_t K, const int8_t* xq, const int32_t* xs,
                           const float* dx, float* res) {
  const int64_t G = K / 32;
  const __m512i low = _mm512_set1_epi8(0xF);
  const __m512i top = _mm512_set1_epi8(0x30);
  // to bits 4-5: rows 0-7 (lanes 0-7) from bits 0-1 (first 4 k) or 4-5 (next 4 k); rows 8-15
  // (lanes 8-15) from bits 2-3 or 6-7
  const __m512i turn_first = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i turn_second =
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 30, 30, 30, 30, 30, 30, 30, 30);
  for (int i = 0; i < MR * 16; ++i) res[i] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* lg = lo + g * 256;  // 16 rows x 32 k at 4 bits
    const uint8_t* hg = hi + g * 128;  // and at 2 bits
    SD_UNROLL for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(lg + 4096 + 64 * line), _MM_HINT_T0);
    SD_UNROLL for (int line = 0; line < 2; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(hg + 2048 + 64 * line), _MM_HINT_T0);
    const int8_t* sg = sc + g * 32;  // the group's two halves' sc: sg, sg + 16
    __m512i sum[MR];
    SD_UNROLL for (int t = 0; t < MR; ++t) sum[t] = _mm512_setzero_si512();
    SD_UNROLL for (int u = 0; u < 2; ++u) {
      __m512i acc[MR];
      SD_UNROLL for (int t = 0; t < MR; ++t) acc[t] = _mm512_setzero_si512();
      SD_UNROLL for (int c = 0; c < 2; ++c) {
        const int q = 2 * u + c;  // k 8q .. 8q + 7 of the group
        const __m512i raw = _mm512_loadu_si512(lg + 64 * q);
        const __m512i w0 = _mm512_and_si512(raw, low);                         // rows 0-7
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);  // rows 8-15
        const __m512i hh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hg + 32 * q)));
        const __m512i first =
            _mm512_or_si512(_mm512_shuffle_i64x2(w0, w1, 0x44),
                            _mm512_and_si512(_mm512_rolv_epi32(hh, turn_first), top));
        const __m512i second =
            _mm512_or_si512(_mm512_shuffle_i64x2(w0, w1, 0xEE),
                            _mm512_and_si512(_mm512_rolv_epi32(hh, turn_second), top));
        dot8_rows<MR>(acc, first, second, xq, K, g * 32 + 8 * q);
      }
      const __m512i s =
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16 * u)));
      SD_UNROLL for (int t = 0; t < MR; ++t)
        sum[t] = _mm512_add_epi32(sum[t], _mm512_mullo_epi32(acc[t], s));
    }
    // per row (sc_a, sc_b) as int16 pairs: with a token's packed (xs_a, xs_b) one vpmaddwd
    const __m128i sa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sg));
    const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16));
    const __m512i ab = _mm512_cvtepi8_epi16(
        _mm256_set_m128i(_mm_unpackhi_epi8(sa, sb), _mm_unpacklo_epi8(sa, sb)));
    const __m512 dv = half16(d + (g * 32 / 256) * 16);
    SD_UNROLL for (int t = 0; t < MR; ++t) {
      float* out = res + t * 16;
      const __m512i offset = _mm512_madd_epi16(ab, _mm512_set1_epi32(xs[t * G + g]));
      const __m512i total = _mm512_sub_epi32(sum[t], _mm512_slli_epi32(offset, 5));
      const __m512 ddx = _mm512_mul_ps(dv, _mm512_set1_ps(dx[t * G + g]));
      _mm512_storeu_ps(out,
                       _mm512_fmadd_ps(ddx, _mm512_cvtepi32_ps(total), _mm512_loadu_ps(out)));
    }
  }
}

}  // namespace

int64_t q6_vnni_tile_rows() { return 12; }

// q6_tile512<mr> (1 <= mr <= q6_vnni_tile_rows()): the arguments of q6_tile
SD_VNNI512 void q6_vnni_tile(int64_t mr, const uint8_t* lo, const uint8_t* hi, const int8_t* sc,
                             const uint16_t* d, int64_t K, const int8_t* xq, const int32_t* xs,
                             const float* dx, float* res) {
  with_tile_rows<12>(
      mr, [&](auto n) { q6_tile512<decltype(n)::value>(lo, hi, sc, d, K, xq, xs, dx, res); });
}

}  // namespace specdecode_kernels
