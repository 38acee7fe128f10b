// The int4 panel tile on AVX2 (see "int4 panels" in linear_avx2.cpp); linear_avx512.cpp has its
// AVX-512 VNNI twin, int4_tile512, which must give the same results bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#ifndef SD_UNROLL
#define SD_UNROLL _Pragma("GCC unroll 16")
#endif

namespace specdecode_kernels {
namespace {

constexpr int64_t kInt4Group = 32;  // k per scale and min (and per activation scale)

inline __m256 half8(const uint16_t* h) {  // 8 float16 -> float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// 8 rows' group scale d * sc and min dl * ml as float32: exact products (an 8-bit code times a
// float16, 19 significant bits at most), so the AVX-512 tile's own computing of them is equal.
inline __m256 group_scale8(const uint8_t* sc, const uint16_t* d) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), half8(d));
}
inline __m256 group_min8(const uint8_t* ml, const uint16_t* dl) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ml));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), half8(dl));
}

// MR tokens x 16 rows (one panel). Per group: 8 steps of 4 k, each one 32-byte load unpacked
// into rows 0-7 and 8-15 (and, shift) and per token one 4-byte broadcast and two byte
// multiply-adds; then each row's group sum sits in a 32-bit lane, and totals (in res, touched
// once per group) += scale dx sum + min xsum, with scale = d sc and min = dl ml from the
// group's codes and its block's steps (block g >> shift). The multiply-add is vpmaddubsw
// summed in 16 bits (8 steps of two products of at most 15 * 127: below 2^15, no saturation),
// then vpmaddwd by ones: the exact integer sum, as int4_tile512's vpdpbusd gives it.
template <int MR>
inline void int4_tile(const uint8_t* p, const uint8_t* codes, const uint16_t* steps, int shift,
                      int64_t K, const int8_t* xq, const float* dx, const float* xsum,
                      float* res) {
  const int64_t G = K / kInt4Group;
  for (int i = 0; i < MR * 16; ++i) res[i] = 0.f;
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[MR][2];
    SD_UNROLL for (int t = 0; t < MR; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    const uint8_t* pg = p + g * (kInt4Group / 2) * 16;
    SD_UNROLL for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(pg + 4096 + 64 * line), _MM_HINT_T0);
    SD_UNROLL for (int s = 0; s < kInt4Group / 4; ++s) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 32 * s));
      const __m256i w0 = _mm256_and_si256(raw, low);                         // rows 0-7
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);  // rows 8-15
      SD_UNROLL for (int t = 0; t < MR; ++t) {
        int32_t four;
        std::memcpy(&four, xq + t * K + g * kInt4Group + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        acc[t][0] = _mm256_add_epi16(acc[t][0], _mm256_maddubs_epi16(w0, xv));
        acc[t][1] = _mm256_add_epi16(acc[t][1], _mm256_maddubs_epi16(w1, xv));
      }
    }
    const uint8_t* cg = codes + g * 32;            // sc [16] uint8, then ml [16] int8
    const uint16_t* sg = steps + (g >> shift) * 32;  // d [16], then dl [16] float16
    SD_UNROLL for (int v = 0; v < 2; ++v) {
      const __m256 s = group_scale8(cg + v * 8, sg + v * 8);
      const __m256 m = group_min8(cg + 16 + v * 8, sg + 16 + v * 8);
      SD_UNROLL for (int t = 0; t < MR; ++t) {
        float* out = res + t * 16 + v * 8;
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[t][v], ones));
        const __m256 sdx = _mm256_mul_ps(s, _mm256_broadcast_ss(dx + t * G + g));
        __m256 total = _mm256_fmadd_ps(sdx, sum, _mm256_loadu_ps(out));
        total = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum + t * G + g), total);
        _mm256_storeu_ps(out, total);
      }
    }
  }
}

}  // namespace
}  // namespace specdecode_kernels
