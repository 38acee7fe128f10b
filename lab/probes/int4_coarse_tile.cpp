// Issue 58's named lever, measured on a whole tile rather than an instruction mix: the 4-bit
// tile of the kernels (int4_tile512 in src/specdecode/kernels/linear_avx512.cpp: per group of
// 32 k, each token's exact int32 sum turned to float and added with its group's scale and min,
// a multiply, a conversion and two FMAs per token and group) against one with a coarser
// activation grid, as llama.cpp's Q4_K x Q8_K: one activation scale per block of 256 k, the
// group sums scaled by their 6-bit codes in integers (`vpmulld`, `vpaddd`), the mins by the
// tokens' group sums in integers (`vpdpwssd`, two groups a time), and one float epilogue per
// block. Same panel layout and unpacking (16 rows, one `vpdpbusd` lane a row); random codes;
// linears of the 1.5B target's shapes over 2 threads (OpenMP over panels), best of 7.
//
//   g++ -O3 -march=native -fopenmp lab/probes/int4_coarse_tile.cpp -o /tmp/coarse && /tmp/coarse
//
// Prints for each shape and row count the two tiles' times, their ratio, and each one's largest
// relative difference from a scalar reference of its own arithmetic (a check of the probe, not
// of the numerics: the two grids give different results by design).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vl")))
#define UNROLL _Pragma("GCC unroll 16")

// One 4-bit linear of N rows (N / 16 panels) and K inputs, in the kernels' layout: per panel and
// group of 32 k, 256 bytes (4 loads of 64: low nibbles rows 0-7, high nibbles rows 8-15, each
// 32-byte half k 8q .. 8q + 3 then 8q + 4 .. 8q + 7 per row), then per group 16 uint8 scale codes
// and 16 int8 min codes; per panel and block of 256 k, 16 float scales d and 16 float mins dl.
struct Linear {
  int64_t N, K;
  std::vector<uint8_t> packed, sc;
  std::vector<int8_t> ml;
  std::vector<float> d, dl;
  // the same mins, per panel and block, as int16 pairs of groups (2j, 2j + 1) per row:
  // [panel][block][4 pairs][16 rows][2]
  std::vector<int16_t> ml_pairs;
};

Linear make_linear(int64_t N, int64_t K, std::mt19937& rng) {
  Linear L{N, K, {}, {}, {}, {}, {}, {}};
  const int64_t P = N / 16, G = K / 32, B = K / 256;
  std::uniform_int_distribution<int> byte(0, 255), code(0, 63), minc(-63, 63);
  std::uniform_real_distribution<float> scale(1e-3f, 2e-3f);
  L.packed.resize(P * G * 256);
  for (auto& b : L.packed) b = uint8_t(byte(rng));
  L.sc.resize(P * G * 16);
  for (auto& c : L.sc) c = uint8_t(code(rng));
  L.ml.resize(P * G * 16);
  for (auto& c : L.ml) c = int8_t(minc(rng));
  L.d.resize(P * B * 16);
  L.dl.resize(P * B * 16);
  for (auto& v : L.d) v = scale(rng);
  for (auto& v : L.dl) v = scale(rng);
  L.ml_pairs.resize(P * B * 4 * 16 * 2);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t b = 0; b < B; ++b)
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < 16; ++r)
          for (int h = 0; h < 2; ++h)
            L.ml_pairs[(((p * B + b) * 4 + j) * 16 + r) * 2 + h] =
                L.ml[(p * G + b * 8 + 2 * j + h) * 16 + r];
  return L;
}

// weight code of row r (0-15) of panel p at k
inline int weight(const Linear& L, int64_t p, int r, int64_t k) {
  const int64_t g = k / 32, q = (k % 32) / 8, j = k % 8;
  const uint8_t* load = L.packed.data() + (p * (L.K / 32) + g) * 256 + 64 * q;
  const int half = j / 4, row = r % 8;  // 32-byte half, then row r's 4 bytes in it
  const uint8_t b = load[32 * half + 4 * row + (j % 4)];
  return r < 8 ? (b & 0xF) : (b >> 4);
}

// Activations: M tokens of K, quantized to int8 with a scale per group of `per` k (32 or 256);
// xsum: the float per-group term the fine tile adds (dx times the group's sum); xs: the integer
// group sums (per 32 k) the coarse tile uses.
struct Acts {
  int per;
  std::vector<int8_t> q;
  std::vector<float> dx, xsum;
  std::vector<int16_t> xs;
};

Acts quantize(const std::vector<float>& x, int64_t M, int64_t K, int per) {
  Acts a{per, std::vector<int8_t>(M * K), {}, {}, {}};
  const int64_t S = K / per, G = K / 32;
  a.dx.resize(M * S);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t s = 0; s < S; ++s) {
      float amax = 0.f;
      for (int i = 0; i < per; ++i) amax = std::max(amax, std::fabs(x[t * K + s * per + i]));
      const float step = amax / 127.f, inv = step > 0 ? 1.f / step : 0.f;
      a.dx[t * S + s] = step;
      for (int i = 0; i < per; ++i)
        a.q[t * K + s * per + i] = int8_t(std::lrint(x[t * K + s * per + i] * inv));
    }
  a.xsum.resize(M * G);
  a.xs.resize(M * G);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t g = 0; g < G; ++g) {
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += a.q[t * K + g * 32 + i];
      a.xs[t * G + g] = int16_t(sum);
      a.xsum[t * G + g] = a.dx[t * S + g * 32 / per] * float(sum);
    }
  return a;
}

template <int MR>
VNNI inline void dot_group(__m512i (&acc)[MR], const uint8_t* pg, const int8_t* xq, int64_t K,
                           int64_t k0) {
  const __m512i low = _mm512_set1_epi8(0xF);
  UNROLL for (int q = 0; q < 4; ++q) {
    const __m512i raw = _mm512_loadu_si512(pg + 64 * q);
    const __m512i w0 = _mm512_and_si512(raw, low);
    const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    const __m512i first = _mm512_shuffle_i64x2(w0, w1, 0x44);
    const __m512i second = _mm512_shuffle_i64x2(w0, w1, 0xEE);
    UNROLL for (int t = 0; t < MR; ++t) {
      int32_t a, b;
      std::memcpy(&a, xq + t * K + k0 + 8 * q, 4);
      std::memcpy(&b, xq + t * K + k0 + 8 * q + 4, 4);
      acc[t] = _mm512_dpbusd_epi32(acc[t], first, _mm512_set1_epi32(a));
      acc[t] = _mm512_dpbusd_epi32(acc[t], second, _mm512_set1_epi32(b));
    }
  }
}

// The kernels' tile: a float epilogue per token and group of 32 k.
template <int MR>
VNNI void fine_tile(const Linear& L, int64_t p, const Acts& a, float* res) {
  const int64_t K = L.K, G = K / 32;
  __m512 total[MR];
  UNROLL for (int t = 0; t < MR; ++t) total[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[MR];
    UNROLL for (int t = 0; t < MR; ++t) acc[t] = _mm512_setzero_si512();
    const uint8_t* pg = L.packed.data() + (p * G + g) * 256;
    _mm_prefetch(reinterpret_cast<const char*>(pg + 4096), _MM_HINT_T0);
    dot_group<MR>(acc, pg, a.q.data(), K, g * 32);
    const int64_t b = g / 8;
    const __m512 d = _mm512_loadu_ps(L.d.data() + (p * (K / 256) + b) * 16);
    const __m512 dl = _mm512_loadu_ps(L.dl.data() + (p * (K / 256) + b) * 16);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(L.sc.data() + (p * G + g) * 16));
    const __m128i ml8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(L.ml.data() + (p * G + g) * 16));
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc8)), d);
    const __m512 m = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ml8)), dl);
    UNROLL for (int t = 0; t < MR; ++t) {
      const __m512 sdx = _mm512_mul_ps(s, _mm512_set1_ps(a.dx[t * G + g]));
      total[t] = _mm512_fmadd_ps(sdx, _mm512_cvtepi32_ps(acc[t]), total[t]);
      total[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xsum[t * G + g]), total[t]);
    }
  }
  UNROLL for (int t = 0; t < MR; ++t) _mm512_storeu_ps(res + t * 16, total[t]);
}

// The coarse tile: per group the token's sum times the group's scale code in integers; per block
// of 256 k the mins in integers and one float epilogue per token.
template <int MR>
VNNI void coarse_tile(const Linear& L, int64_t p, const Acts& a, float* res) {
  const int64_t K = L.K, G = K / 32, B = K / 256;
  __m512 total[MR];
  UNROLL for (int t = 0; t < MR; ++t) total[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i block[MR];
    UNROLL for (int t = 0; t < MR; ++t) block[t] = _mm512_setzero_si512();
    for (int64_t g = b * 8; g < b * 8 + 8; ++g) {
      __m512i acc[MR];
      UNROLL for (int t = 0; t < MR; ++t) acc[t] = _mm512_setzero_si512();
      const uint8_t* pg = L.packed.data() + (p * G + g) * 256;
      _mm_prefetch(reinterpret_cast<const char*>(pg + 4096), _MM_HINT_T0);
      dot_group<MR>(acc, pg, a.q.data(), K, g * 32);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(L.sc.data() + (p * G + g) * 16));
      const __m512i sc = _mm512_cvtepu8_epi32(sc8);
      UNROLL for (int t = 0; t < MR; ++t)
        block[t] = _mm512_add_epi32(block[t], _mm512_mullo_epi32(acc[t], sc));
    }
    __m512i mins[MR];  // after the groups: 12 tokens' sums and mins would not fit the registers
    UNROLL for (int t = 0; t < MR; ++t) mins[t] = _mm512_setzero_si512();
    const int16_t* pairs = L.ml_pairs.data() + (p * B + b) * 4 * 32;
    UNROLL for (int j = 0; j < 4; ++j) {
      const __m512i mp = _mm512_loadu_si512(pairs + 32 * j);
      UNROLL for (int t = 0; t < MR; ++t) {
        int32_t two;
        std::memcpy(&two, a.xs.data() + t * G + b * 8 + 2 * j, 4);
        mins[t] = _mm512_dpwssd_epi32(mins[t], mp, _mm512_set1_epi32(two));
      }
    }
    const __m512 d = _mm512_loadu_ps(L.d.data() + (p * B + b) * 16);
    const __m512 dl = _mm512_loadu_ps(L.dl.data() + (p * B + b) * 16);
    UNROLL for (int t = 0; t < MR; ++t) {
      const __m512 step = _mm512_set1_ps(a.dx[t * B + b]);
      total[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, step), _mm512_cvtepi32_ps(block[t]), total[t]);
      total[t] = _mm512_fmadd_ps(_mm512_mul_ps(dl, step), _mm512_cvtepi32_ps(mins[t]), total[t]);
    }
  }
  UNROLL for (int t = 0; t < MR; ++t) _mm512_storeu_ps(res + t * 16, total[t]);
}

// out[t][n] for MR tokens over every panel, OpenMP over panels
template <int MR, bool COARSE>
void linear(const Linear& L, const Acts& a, float* out) {
  const int64_t P = L.N / 16;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    alignas(64) float res[MR * 16];
    if constexpr (COARSE)
      coarse_tile<MR>(L, p, a, res);
    else
      fine_tile<MR>(L, p, a, res);
    for (int t = 0; t < MR; ++t) std::memcpy(out + t * L.N + p * 16, res + t * 16, 64);
  }
}

double reference(const Linear& L, const Acts& a, int64_t t, int64_t n, bool coarse) {
  const int64_t K = L.K, G = K / 32, B = K / 256, p = n / 16;
  const int r = int(n % 16);
  double total = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t sum = 0;
    for (int64_t k = g * 32; k < g * 32 + 32; ++k) sum += int64_t(weight(L, p, r, k)) * a.q[t * K + k];
    const int64_t b = g / 8;
    const double d = L.d[(p * B + b) * 16 + r], dl = L.dl[(p * B + b) * 16 + r];
    const double sc = L.sc[(p * G + g) * 16 + r], ml = L.ml[(p * G + g) * 16 + r];
    const double step = coarse ? a.dx[t * B + b] : a.dx[t * G + g];
    total += d * sc * step * double(sum) + dl * ml * step * double(a.xs[t * G + g]);
  }
  return total;
}

// seconds per linear, best of 7 passes over every copy (more bytes than the L3 cache holds, so
// the weights come from memory as in a forward; the last copy's result in `out`)
template <int MR, bool COARSE>
double best_seconds(const std::vector<Linear>& copies, const Acts& a, std::vector<float>& out) {
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const Linear& L : copies) linear<MR, COARSE>(L, a, out.data());
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count() / copies.size());
  }
  return best;
}

template <int MR>
void measure(const std::vector<Linear>& copies, std::mt19937& rng) {
  const Linear& L = copies.back();
  const int64_t M = MR, K = L.K;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(M * K);
  for (auto& v : x) v = normal(rng);
  const Acts fine = quantize(x, M, K, 32), coarse = quantize(x, M, K, 256);
  std::vector<float> out_f(M * L.N), out_c(M * L.N);
  const double tf = best_seconds<MR, false>(copies, fine, out_f);
  const double tc = best_seconds<MR, true>(copies, coarse, out_c);
  double err_f = 0, err_c = 0;
  for (int64_t t = 0; t < M; ++t)
    for (int64_t n = 0; n < L.N; n += 97) {
      const double rf = reference(L, fine, t, n, false), rc = reference(L, coarse, t, n, true);
      err_f = std::max(err_f, std::fabs(out_f[t * L.N + n] - rf) / (std::fabs(rf) + 1e-3));
      err_c = std::max(err_c, std::fabs(out_c[t * L.N + n] - rc) / (std::fabs(rc) + 1e-3));
    }
  std::printf("%5ld x %5ld  rows %2d  fine %8.3f ms  coarse %8.3f ms  fine/coarse %.3f  "
              "(check: %.1e, %.1e)\n",
              long(L.N), long(L.K), MR, tf * 1e3, tc * 1e3, tf / tc, err_f, err_c);
}

int main() {
  std::printf("threads %d\n", omp_get_max_threads());
  std::mt19937 rng(0);
  // the 1.5B target's gate (and up) and down projections, 12 copies of each (83 MB of codes)
  std::vector<Linear> gate, down;
  for (int i = 0; i < 12; ++i) {
    gate.push_back(make_linear(8960, 1536, rng));
    down.push_back(make_linear(1536, 8960, rng));
  }
  for (int round = 0; round < 2; ++round) {
    for (const auto* copies : {&gate, &down}) {
      measure<1>(*copies, rng);
      measure<4>(*copies, rng);
      measure<8>(*copies, rng);
      measure<12>(*copies, rng);
    }
  }
}
