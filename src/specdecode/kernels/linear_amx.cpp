// bfloat16 panels on AMX (Intel Sapphire Rapids and later), called from linear_avx2.cpp's
// `linear_packed` where the CPU has it and the process has not turned it off.
//
// A panel's layout [K/2][16][2] is exactly AMX's B-tile layout for bfloat16: 16 rows of 64 bytes,
// each a pair of k for the panel's 16 outputs. So a tile of up to 16 tokens' activations
// (A: tokens x 32 k) times one panel's 32 k (B: 16 pairs x 16 outputs) adds into a tile of
// tokens x 16 float32 sums (C) in one `tdpbf16ps`: 512 multiply-adds per instruction, with the
// weights read straight from the panels. Verifying a dozen tokens then costs about what one
// token costs, where the AVX-512 BF16 path's work grows with every token
// (docs/benchmarks.md, "bfloat16 panels on AMX").
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

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernel_common.h"

#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define SD_HAVE_AMX 1
#define SD_AMX __attribute__((target("amx-tile,amx-bf16")))
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

// C (tiles 0-1): m tokens x 16 float32 for two panels; A (tile 2): m tokens x 32 bfloat16; B
// (tiles 3-4): 16 pairs x 16 outputs x 2 bfloat16, one per panel. Per thread (tile state is a
// thread's).
SD_AMX void configure(int m) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = uint8_t(m);
  cfg.rows[3] = cfg.rows[4] = 16;
  // GCC 12's _tile_loadconfig declares a read of 8 bytes only, so the compiler may drop the
  // stores of the rest as dead (its ldtilecfg then faults): the whole struct is the operand
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

SD_AMX void release() { _tile_release(); }

// tokens x[0..m) (row stride K) against two panels (the second `stride` elements on) -> c0, c1
// [m][16] float32 each. Two accumulators in flight: one panel's chain of tdpbf16ps waits on
// itself, so a token alone would leave the unit idle between them. Each panel's sums are its
// own chain over k in order, as with one panel at a time.
SD_AMX void panel_pair(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t stride,
                       float* c0, float* c1) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < K; k += kAmxK) {
    _tile_loadd(2, x + k, K * 2);
    _tile_loadd(3, panel + k * 16, 64);
    _tile_loadd(4, panel + stride + k * 16, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, c0, 64);
  _tile_stored(1, c1, 64);
}

// one panel alone (the last of an odd count): the same chain into c
SD_AMX void panel_one(const uint16_t* x, int64_t K, const uint16_t* panel, float* c) {
  _tile_zero(0);
  for (int64_t k = 0; k < K; k += kAmxK) {
    _tile_loadd(2, x + k, K * 2);
    _tile_loadd(3, panel + k * 16, 64);
    _tile_dpbf16ps(0, 2, 3);
  }
  _tile_stored(0, c, 64);
}

void write_out(const float* c, int m, int64_t m0, int64_t n0, int64_t N, const float* bias,
               uint16_t* out) {
  const int64_t cols = N - n0 < 16 ? N - n0 : 16;
  for (int t = 0; t < m; ++t)
    for (int64_t i = 0; i < cols; ++i)
      out[(m0 + t) * N + n0 + i] = float_to_bf16(c[t * 16 + i] + (bias ? bias[n0 + i] : 0.f));
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

SD_AMX void bf16_amx_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels,
                            int64_t N, const float* bias, uint16_t* out, int64_t p0, int64_t p1) {
  alignas(64) float c[2][16 * 16];
  const int64_t stride = K * 16;  // elements per panel
  int configured = 0;
  for (int64_t p = p0; p < p1; p += 2) {
    const bool pair = p + 1 < p1;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int m = int(M - m0 < 16 ? M - m0 : 16);
      if (m != configured) {
        configure(m);
        configured = m;
      }
      if (pair) {
        panel_pair(x + m0 * K, K, panels + p * stride, stride, c[0], c[1]);
        write_out(c[1], m, m0, (p + 1) * 16, N, bias, out);
      } else {
        panel_one(x + m0 * K, K, panels + p * stride, c[0]);
      }
      write_out(c[0], m, m0, p * 16, N, bias, out);
    }
  }
  if (configured) release();
}

#else  // no AMX in this compiler or OS: never supported, never called

bool bf16_amx_supported() { return false; }
void bf16_amx_panels(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                     uint16_t*, int64_t, int64_t) {}

#endif

}  // namespace specdecode_kernels
