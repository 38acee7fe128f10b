// The machine's arithmetic peak for the int4 and 6-bit tiles: one core's rate of independent
// `vpdpbusd` (512-bit, 64 byte multiply-adds each) and of 512-bit FMAs, 12 chains in flight; then
// what a tile's per-group epilogue costs beside 8 `vpdpbusd` (does it share their units?).
//
//   g++ -O2 -march=native lab/probes/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak
//
// A product of n rows over 4-bit weights costs about one row's time (reading the weights) until
// n rows' multiply-adds take longer than that at this rate times the cores: v(n) cannot drop
// below n x (multiply-adds per row) / (cores x this rate) / (one row's time).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double vnni_seconds(int64_t iters) {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(a));  // keeps the loop from being folded
  }
  const auto t1 = std::chrono::steady_clock::now();
  int sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm512_reduce_add_epi32(acc[i]);
  if (sum == 42) std::printf(" ");
  return std::chrono::duration<double>(t1 - t0).count();
}

__attribute__((target("avx512f"))) double fma_seconds(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i));
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    asm volatile("" : "+v"(a));
  }
  const auto t1 = std::chrono::steady_clock::now();
  float sum = 0.f;
  for (int i = 0; i < 12; ++i) sum += _mm512_reduce_add_ps(acc[i]);
  if (sum == 42.f) std::printf(" ");
  return std::chrono::duration<double>(t1 - t0).count();
}

// 8 independent `vpdpbusd` chains per iteration, and beside them what a tile's epilogue per token
// and group of 32 k would add: EXTRA 0 nothing; 1 the 4-bit tile's (a multiply, a conversion and
// two FMAs); 2 an integer scale of the group's sum (`vpmulld` and `vpaddd`), what a coarser
// activation grid (one scale per 256 k) would need instead; 3 one `vpdpwssd` (its mins, two
// groups at a time). Seconds for `iters`.
template <int EXTRA>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) double mixed_seconds(int64_t iters) {
  __m512i acc[8], ia = _mm512_set1_epi32(1);
  __m512 f = _mm512_set1_ps(1.f);
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), s = _mm512_set1_epi32(7);
  __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.999f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    if constexpr (EXTRA == 1) {
      const __m512 sdx = _mm512_mul_ps(x, y);
      f = _mm512_fmadd_ps(sdx, _mm512_cvtepi32_ps(a), f);
      f = _mm512_fmadd_ps(x, y, f);
    } else if constexpr (EXTRA == 2) {
      ia = _mm512_add_epi32(ia, _mm512_mullo_epi32(a, s));
    } else if constexpr (EXTRA == 3) {
      ia = _mm512_dpwssd_epi32(ia, a, s);
    }
    asm volatile("" : "+v"(a), "+v"(x));
  }
  const auto t1 = std::chrono::steady_clock::now();
  int sum = _mm512_reduce_add_epi32(ia) + int(_mm512_reduce_add_ps(f));
  for (int i = 0; i < 8; ++i) sum += _mm512_reduce_add_epi32(acc[i]);
  if (sum == 42) std::printf(" ");
  return std::chrono::duration<double>(t1 - t0).count();
}

int main() {
  const int64_t iters = 200000000 / 12;
  vnni_seconds(iters / 10);  // warm-up: the clock ramps up
  const double v = vnni_seconds(iters), f = fma_seconds(iters);
  const double n = double(iters) * 12;
  std::printf("vpdpbusd zmm: %.3f ns each, %.1f G byte multiply-adds/s on one core\n",
              v / n * 1e9, n * 64 / v / 1e9);
  std::printf("vfmadd zmm:   %.3f ns each, %.1f G float32 FMAs/s on one core\n", f / n * 1e9,
              n * 16 / f / 1e9);
  const int64_t mix = 20000000;
  const double alone = mixed_seconds<0>(mix), tile = mixed_seconds<1>(mix),
               scaled = mixed_seconds<2>(mix), mins = mixed_seconds<3>(mix);
  std::printf("8 vpdpbusd: %.2f ns; with the 4-bit tile's epilogue beside them %.2f (%.2fx); "
              "with vpmulld + vpaddd %.2f (%.2fx); with one vpdpwssd %.2f (%.2fx)\n",
              alone / mix * 1e9, tile / mix * 1e9, tile / alone, scaled / mix * 1e9,
              scaled / alone, mins / mix * 1e9, mins / alone);
}
