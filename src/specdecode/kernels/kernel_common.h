// What linear_avx2.cpp, linear_avx512.cpp and draft_ops.cpp share: bfloat16 <-> float32
// conversions as PyTorch does them, one fixed-order horizontal sum of a 256-bit vector, and the
// step from a block's token count to a tile's compile-time one.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace specdecode_kernels {

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float lane_sum(__m256 v) {  // one fixed order for every caller
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// f(std::integral_constant<int, n>{}) with n = min(mr, Most), at least 1: a tile of n tokens
template <int Most, class F>
inline void with_tile_rows(int64_t mr, F&& f) {
  if constexpr (Most > 1) {
    if (mr >= Most) {
      f(std::integral_constant<int, Most>{});
      return;
    }
    with_tile_rows<Most - 1>(mr, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace specdecode_kernels
