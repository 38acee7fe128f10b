// What the int4 and 6-bit tiles on 512-bit vectors share (linear_avx512.cpp's VNNI tiles and
// linear_amx.cpp's AMX tile): 16 float16 steps widened, and 16 rows' 8-bit codes times their
// steps. Only functions with AVX-512 target attributes: a file that includes this header without
// calling them compiles no AVX-512 instruction.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace specdecode_kernels {
namespace {

#define SD_CODES512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

SD_CODES512 inline __m512 half16(const uint16_t* h) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// 16 rows' codes (uint8 sc or int8 ml) times their float16 steps: exact, as int4_tile.h's
SD_CODES512 inline __m512 coded16(const uint8_t* codes, const uint16_t* steps, bool is_signed) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), half16(steps));
}

#undef SD_CODES512

}  // namespace
}  // namespace specdecode_kernels
