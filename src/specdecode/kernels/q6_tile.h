// The 6-bit panel tile on AVX2 (see "6-bit panels" in linear_avx2.cpp): GGUF Q6_K's grid,
// w = d sc (q - 32) with q in 0..63, a signed 8-bit sc per row and 16 k, a float16 d per row and
// 256 k. linear_avx512.cpp has its AVX-512 VNNI twin, q6_tile512, which must give the same
// results bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int4_tile.h"

namespace specdecode_kernels {
namespace {

constexpr int64_t kQ6Sub = 16;     // k per sc
constexpr int64_t kQ6Block = 256;  // k per d

// 8 int8 scales, each twice, as 16 int16 lanes: vpmaddwd's pairs of one row
inline __m256i scale_pairs(const int8_t* s) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}

// 8 rows' (sc_a, sc_b) as int16 pairs: with a token's (xs_a, xs_b) one vpmaddwd gives each row
// sc_a xs_a + sc_b xs_b
inline __m256i scale_ab(const int8_t* a, const int8_t* b) {
  const __m128i va = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(va, vb));
}

// MR tokens x 16 rows (one panel). lo: the panel's low 4 bits as an int4 panel [K / 4][32];
// hi: the top 2 bits [K / 8][32], byte 4r + j of step pair t holding, from bit 0, rows r and
// r + 8 at k = 8t + j, then rows r and r + 8 at k = 8t + 4 + j; sc [K / 16][16] int8;
// d [K / 256][16] float16. xs: per token and group of 32, the int16 sums of xq over its two
// halves, packed (first | second << 16). Per group an exact int32 sum, as in int4_tile:
// vpmaddubsw of q (0..63) by xq summed in 16 bits over 2 steps (4 products of at most
// 63 * 127: below 2^15), then vpmaddwd by sc, minus 32 (sc_a xs_a + sc_b xs_b); then
// res += (d dx) sum.
template <int MR>
inline void q6_tile(const uint8_t* lo, const uint8_t* hi, const int8_t* sc, const uint16_t* d,
                    int64_t K, const int8_t* xq, const int32_t* xs, const float* dx,
                    float* res) {
  const int64_t G = K / kInt4Group;
  for (int i = 0; i < MR * 16; ++i) res[i] = 0.f;
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i top = _mm256_set1_epi8(0x30);
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[MR][2];
    SD_UNROLL for (int t = 0; t < MR; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    const int8_t* sg = sc + g * 2 * 16;  // the group's two halves: sg, sg + 16
    SD_UNROLL for (int u = 0; u < 2; ++u) {
      const __m256i s0 = scale_pairs(sg + u * 16), s1 = scale_pairs(sg + u * 16 + 8);
      SD_UNROLL for (int c = 0; c < 2; ++c) {
        const int64_t pair = g * 4 + u * 2 + c;  // steps 2 pair, 2 pair + 1
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + 32 * pair));
        __m256i part[MR][2];
        SD_UNROLL for (int e = 0; e < 2; ++e) {
          const int64_t s = 2 * pair + e;
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 32 * s));
          const __m256i h0 = e ? h : _mm256_slli_epi16(h, 4);
          const __m256i h1 = e ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2);
          const __m256i w0 = _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(h0, top));
          const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                             _mm256_and_si256(h1, top));
          SD_UNROLL for (int t = 0; t < MR; ++t) {
            int32_t four;
            std::memcpy(&four, xq + t * K + 4 * s, 4);
            const __m256i xv = _mm256_set1_epi32(four);
            const __m256i p0 = _mm256_maddubs_epi16(w0, xv), p1 = _mm256_maddubs_epi16(w1, xv);
            part[t][0] = e ? _mm256_add_epi16(part[t][0], p0) : p0;
            part[t][1] = e ? _mm256_add_epi16(part[t][1], p1) : p1;
          }
        }
        SD_UNROLL for (int t = 0; t < MR; ++t) {
          acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(part[t][0], s0));
          acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(part[t][1], s1));
        }
      }
    }
    SD_UNROLL for (int v = 0; v < 2; ++v) {
      const __m256i ab = scale_ab(sg + v * 8, sg + 16 + v * 8);
      const __m256 dv = half8(d + (g * kInt4Group / kQ6Block) * 16 + v * 8);
      SD_UNROLL for (int t = 0; t < MR; ++t) {
        float* out = res + t * 16 + v * 8;
        const __m256i offset = _mm256_madd_epi16(ab, _mm256_set1_epi32(xs[t * G + g]));
        const __m256i sum = _mm256_sub_epi32(acc[t][v], _mm256_slli_epi32(offset, 5));
        const __m256 ddx = _mm256_mul_ps(dv, _mm256_broadcast_ss(dx + t * G + g));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(sum), _mm256_loadu_ps(out)));
      }
    }
  }
}

}  // namespace
}  // namespace specdecode_kernels
