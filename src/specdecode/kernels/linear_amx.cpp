// bfloat16 panels on AMX (Intel Sapphire Rapids and later), called from linear_avx2.cpp's
// `linear_packed` where the CPU has it and the process has not turned it off.
//
// A panel's layout [K/2][16][2] is exactly AMX's B-tile layout for bfloat16: 16 rows of 64 bytes,
// each a pair of k for the panel's 16 outputs. So a tile of up to 16 tokens' activations
// (A: tokens x 32 k) times one panel's 32 k (B: 16 pairs x 16 outputs) adds into a tile of
// tokens x 16 float32 sums (C) in one `tdpbf16ps`: 512 multiply-adds per instruction, with the
// weights read straight from the panels. Verifying a dozen tokens then costs about what one
// token costs, where the AVX-512 BF16 path's work grows with every token
// (docs/results.md).
//
// Batch invariance: each output row is its own row of the C tile, accumulated over the same
// 32-k blocks in the same order whatever the number of tokens in the call or the rows of the
// tile; the instruction's own order within a block is fixed. It rounds differently from the
// AVX-512 BF16 chain (a few outputs in ten thousand differ in the last bfloat16 bit), so, as
// there, a process uses one path for every forward (`set_bf16_amx`). Linears whose K is not a
// multiple of 32 keep the other paths.
//
// Like linear_avx512.cpp, this file holds only functions compiled for their instructions (target
// attributes) and includes no PyTorch header.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "int4_codes512.h"
#include "kernel_common.h"

#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define SD_HAVE_AMX 1
#define SD_AMX __attribute__((target("amx-tile,amx-bf16")))
#define SD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#endif

namespace specdecode_kernels {

constexpr int64_t kAmxK = 32;  // k per tile step: 16 pairs, one 64-byte row of A and of B

#if defined(SD_HAVE_AMX) && defined(__linux__)
namespace {

struct alignas(64) TileConfig {  // the `ldtilecfg` operand, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Rows go in blocks of 16 (a tile's most), two blocks per pass: C (tiles 0-3) holds a x 16 and
// b x 16 float32 sums for each of two panels, A (tiles 4-5) a and b tokens x 32 bfloat16, B
// (tiles 6-7) 16 pairs x 16 outputs x 2 bfloat16, one per panel. So up to 32 tokens read each
// panel's weights once, under one configuration per call. Per thread (tile state is a thread's).
SD_AMX void configure(int a, int b) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = uint8_t(a);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = uint8_t(b);
  cfg.rows[6] = cfg.rows[7] = 16;
  // GCC 12's _tile_loadconfig declares a read of 8 bytes only, so the compiler may drop the
  // stores of the rest as dead (its ldtilecfg then faults): the whole struct is the operand
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

SD_AMX void release() { _tile_release(); }

// Tokens xa (block a) and, where `both`, xb (block b), row stride K (`packed`: each block's
// [K/32][16][32], every A tile 1 KB in one piece), against two panels (the
// second `stride` elements on; stride 0 repeats the first) -> c[0], c[1] (block a) and c[2], c[3]
// (block b), [rows][16] float32 each. Four chains in flight: one panel's chain of tdpbf16ps waits
// on itself, so a token alone would leave the unit idle. Each output's sum is its own chain over
// k in order, whatever the block, the pass or the number of tokens.
template <bool both, bool packed>
SD_AMX void panel_pair(const uint16_t* xa, const uint16_t* xb, int64_t K, const uint16_t* panel,
                       int64_t stride, float (*c)[16 * 16]) {
  _tile_zero(0);
  _tile_zero(1);
  if (both) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kAmxK) {
    if (packed)
      _tile_loadd(4, xa + k * 16, 64);
    else
      _tile_loadd(4, xa + k, K * 2);
    _tile_loadd(6, panel + k * 16, 64);
    _tile_loadd(7, panel + stride + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (both) {
      if (packed)
        _tile_loadd(5, xb + k * 16, 64);
      else
        _tile_loadd(5, xb + k, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (both) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

// c [m][16] plus the bias -> bfloat16 outputs (rows m0.., columns n0..), rounded as
// float_to_bf16 (to nearest even, NaN kept): 16 at a time, a prefill writes many
SD_AVX512 void write_out(const float* c, int m, int64_t m0, int64_t n0, int64_t N,
                         const float* bias, uint16_t* out) {
  const int64_t cols = N - n0 < 16 ? N - n0 : 16;
  if (cols < 16) {
    for (int t = 0; t < m; ++t)
      for (int64_t i = 0; i < cols; ++i)
        out[(m0 + t) * N + n0 + i] = float_to_bf16(c[t * 16 + i] + (bias ? bias[n0 + i] : 0.f));
    return;
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  for (int t = 0; t < m; ++t) {
    // + 0 where there is no bias, as the scalar form: the same sum, bit for bit
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(_mm512_loadu_ps(c + t * 16), b));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), inf);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + t) * N + n0),
                        _mm512_cvtepi32_epi16(r));
  }
}

bool os_lets_amx() {  // the kernel saves tile state (XCR0 bits 17, 18) and grants this process it
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool bf16_amx_supported() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!(c & (1u << 27))) return false;  // OSXSAVE: xgetbv may run
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    return tile && bf16 && os_lets_amx();
  }();
  return ok;
}

// Panels p0 .. p1 (`panels`: the first of them), tokens in passes of 32 (two blocks of 16; fewer
// tokens in all, blocks of min(M, 16) and the rest): every pass under the same configuration. Past 32 tokens, a last pass of fewer than 32
// runs on a copy of its rows padded to 16 or 32 (rows past M are computed and dropped), so the
// tiles are configured once per call and the panels stay in cache across a panel's passes.
// `packed`: x is [M/16][K/32][16][32] (M a multiple of 32, or 16 at most): the rows of a tile
// in one 1 KB piece, not 16 rows K apart (a prefill's many rows, packed once per call).
SD_AMX void bf16_amx_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels,
                            int64_t N, const float* bias, uint16_t* out, int64_t p0, int64_t p1,
                            bool packed) {
  if (p0 >= p1) return;
  alignas(64) float c[4][16 * 16];
  const int64_t stride = K * 16;  // elements per panel
  const int a = int(M < 16 ? M : 16), b = int(M <= 32 ? (M > 16 ? M - 16 : 0) : 16);
  const int64_t full = M <= 32 ? M : M / 32 * 32, rest = M - full;  // rest: rows of a padded pass
  thread_local std::vector<uint16_t> padded;  // [32][K]: the last pass's rows, then zeros
  if (rest) {
    padded.assign(size_t(32 * K), 0);
    std::memcpy(padded.data(), x + full * K, size_t(rest * K) * sizeof(uint16_t));
  }
  configure(a, b ? b : 1);
  for (int64_t p = p0; p < p1; p += 2) {
    const bool pair = p + 1 < p1;
    const uint16_t* panel = panels + (p - p0) * stride;
    const int64_t second = pair ? stride : 0;
    auto pass = [&](const uint16_t* rows, int64_t m0, int64_t m) {  // m <= 32 rows from m0
      if (packed && m > 16)
        panel_pair<true, true>(rows, rows + 16 * K, K, panel, second, c);
      else if (packed)
        panel_pair<false, true>(rows, nullptr, K, panel, second, c);
      else if (m > 16)
        panel_pair<true, false>(rows, rows + 16 * K, K, panel, second, c);
      else
        panel_pair<false, false>(rows, nullptr, K, panel, second, c);
      for (int blk = 0; blk < 2 && blk * 16 < m; ++blk) {
        const int rows_in = int(m - blk * 16 < 16 ? m - blk * 16 : 16);
        write_out(c[2 * blk], rows_in, m0 + blk * 16, p * 16, N, bias, out);
        if (pair) write_out(c[2 * blk + 1], rows_in, m0 + blk * 16, (p + 1) * 16, N, bias, out);
      }
    };
    for (int64_t m0 = 0; m0 < full; m0 += 32) pass(x + m0 * K, m0, full - m0 < 32 ? full - m0 : 32);
    if (rest) pass(padded.data(), full, rest);
  }
  release();
}

// ---- 4-bit and 6-bit panels as bfloat16 panels, for a prefill's many rows ------------------
// The 4-bit and 6-bit tiles (linear_avx2.cpp) compute each token's 16 rows with 8-bit
// activations and a float32 epilogue per group of 32 k, which bounds them by arithmetic once a
// forward has more than a few rows. A prefill of many rows (never a verification: the caller,
// the lean forward's `_prefill`, takes it past VERIFY_TOKENS rows only) may round otherwise, as
// bfloat16 targets' prefills on PyTorch's product do: each pair of panels is unpacked here into
// bfloat16 panels (one rounding to bfloat16) and run on the AMX bfloat16 tiles above over every
// token, with bfloat16 activations (not quantized). Nothing is kept. (Every CPU with AMX has the
// AVX-512 the unpacking uses.)

// 64 bytes of a 4-bit panel (two 4-k steps of 16 rows, the low and high nibbles rows 0-7 and
// 8-15) -> each step's rows 0-15, lane i row i's 4 codes: the regrouping int4_tile512 does
SD_AVX512 inline void nibble_steps(const uint8_t* p, __m512i (&steps)[2]) {
  const __m512i low = _mm512_set1_epi8(0xF), raw = _mm512_loadu_si512(p);
  const __m512i w0 = _mm512_and_si512(raw, low);                         // rows 0-7
  const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);  // rows 8-15
  steps[0] = _mm512_shuffle_i64x2(w0, w1, 0x44);
  steps[1] = _mm512_shuffle_i64x2(w0, w1, 0xEE);
}

// float32 -> bfloat16 bits (round to nearest even; never NaN here) in each lane's low half
SD_AVX512 inline __m512i bf16_bits(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)),
                           16);
}

// 16 rows' weights at 4 consecutive k (w[j] = scale(code j of each lane) as float32, lane i row
// i) -> two pair rows of a bfloat16 panel at `at` ([2][16][2]: k, k + 1, then k + 2, k + 3)
template <class Weight>
SD_AVX512 inline void store_pairs(__m512i steps, Weight weight, uint16_t* at) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  __m512i w[4];
  for (int j = 0; j < 4; ++j)
    w[j] = bf16_bits(weight(_mm512_and_si512(_mm512_srli_epi32(steps, 8 * j), byte)));
  _mm512_storeu_si512(at, _mm512_or_si512(w[0], _mm512_slli_epi32(w[1], 16)));
  _mm512_storeu_si512(at + 32, _mm512_or_si512(w[2], _mm512_slli_epi32(w[3], 16)));
}

// One int4 panel (codes: the 4-bit layout, 16 rows x K) -> its bfloat16 panel [K/2][16][2]:
// w = scale q + min
SD_AVX512 void int4_bf16_panel(const uint8_t* p, const uint8_t* codes, const uint16_t* steps,
                               int shift, int64_t K, uint16_t* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* cg = codes + g * 32;              // sc [16] uint8, then ml [16] int8
    const uint16_t* sg = steps + (g >> shift) * 32;  // d [16], then dl [16] float16
    const __m512 s = coded16(cg, sg, false), m = coded16(cg + 16, sg + 16, true);
    const auto weight = [s, m](__m512i code) SD_AVX512 {
      return _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(code), m);
    };
    for (int q = 0; q < 4; ++q) {  // k 8q .. 8q + 7 of the group
      __m512i pair[2];
      nibble_steps(p + g * 256 + 64 * q, pair);
      for (int h = 0; h < 2; ++h) store_pairs(pair[h], weight, out + (g * 32 + 8 * q + 4 * h) * 16);
    }
  }
}

// One 6-bit panel (q6_tile.h's layout: lo, an int4 panel of the low 4 bits; hi, the top 2 bits
// [K/8][32], byte 4r + j of step pair t holding from bit 0 rows r and r + 8 at k = 8t + j, then
// rows r and r + 8 at k = 8t + 4 + j; sc [K/16][16] int8; d [K/256][16] float16) -> its bfloat16
// panel [K/2][16][2]: w = (d sc) (q - 32), rounded once to bfloat16
SD_AVX512 void q6_bf16_panel(const uint8_t* lo, const uint8_t* hi, const int8_t* sc,
                             const uint16_t* d, int64_t K, uint16_t* out) {
  const __m512i two = _mm512_set1_epi8(0x3), mid = _mm512_set1_epi32(32);
  // per half of the 8 k: rows 0-7's top bits at 4e, rows 8-15's at 4e + 2
  const __m512i shifts[2] = {_mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0),
                             _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4)};
  for (int64_t t = 0; t < K / 8; ++t) {  // k 8t .. 8t + 7, every row
    __m512i lows[2];
    nibble_steps(lo + 64 * t, lows);
    // top bits: 32 bytes, widened to both halves of a register (rows 0-7 low, 8-15 high)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + 32 * t));
    const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
    const int64_t k0 = 8 * t;
    const __m512 scale = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (k0 / 16) * 16)))),
        half16(d + (k0 / 256) * 16));
    const auto weight = [scale, mid](__m512i code) SD_AVX512 {
      return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(code, mid)));
    };
    for (int e = 0; e < 2; ++e) {
      const __m512i top = _mm512_and_si512(_mm512_srlv_epi64(hh, shifts[e]), two);
      const __m512i q = _mm512_or_si512(lows[e], _mm512_slli_epi16(top, 4));  // lane i: row i
      store_pairs(q, weight, out + (k0 + 4 * e) * 16);
    }
  }
}

#else  // no AMX in this compiler or OS: never supported, never called

bool bf16_amx_supported() { return false; }
void bf16_amx_panels(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                     uint16_t*, int64_t, int64_t, bool) {}
void int4_bf16_panel(const uint8_t*, const uint8_t*, const uint16_t*, int, int64_t, uint16_t*) {}
void q6_bf16_panel(const uint8_t*, const uint8_t*, const int8_t*, const uint16_t*, int64_t,
                   uint16_t*) {}

#endif

}  // namespace specdecode_kernels
