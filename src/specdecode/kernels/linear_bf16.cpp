// A bfloat16 linear layer for CPUs with AVX2 + FMA, made for decoding: few tokens, big weights.
//
// Why: on x86 CPUs without bfloat16 matrix units, PyTorch's bfloat16 matmul costs about one extra
// one-token forward per extra token, so verifying k+1 drafted tokens costs about k+1 forwards and
// speculation cannot pay. Here every weight row is read from memory once per call and used for all
// the tokens while it sits in L1, so a forward over a few tokens costs about as much as over one:
// the memory-bound regime speculative decoding is built on.
//
// Batch invariance: each output is one float32 sum over k in a fixed order (8 lanes, each an FMA
// chain over its k in order, then the lanes added in a fixed order), whatever the number of tokens
// in the call or the tile that computes it. A linear layer's output for a token is bit-identical
// whether the token is decoded alone or verified among k others. (Attention and the rest of the
// model are PyTorch's and can still round differently with the number of tokens, so bfloat16
// greedy identity keeps its near-tie exception.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 8;     // weight rows per parallel work item (24 KB when K = 1536)
constexpr int64_t kPrefetch = 8;  // prefetch the same place kPrefetch rows ahead (the next group)

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

// R weight rows x T tokens. x holds each 16-wide chunk of a token as [8 even | 8 odd] float32
// values, so one 256-bit load of 16 bfloat16 weights becomes two float32 vectors with one shift
// (even elements) and one mask (odd elements). res[t * R + r] = dot(w[r], x[t]).
template <int R, int T>
inline void tile(const uint16_t* w, int64_t K, const float* x, float* res) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 even[T], odd[T];
    for (int t = 0; t < T; ++t) {
      even[t] = _mm256_loadu_ps(x + t * K + k);
      odd[t] = _mm256_loadu_ps(x + t * K + k + 8);
    }
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetch + r) * K + k), _MM_HINT_T0);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
      const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm256_fmadd_ps(w_even, even[t], acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(w_odd, odd[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = lane_sum(acc[r][t]);
      for (int64_t k = K16; k < K; ++k) s += bf16_to_float(w[r * K + k]) * x[t * K + k];
      res[t * R + r] = s;
    }
}

// out[m0 .. m0+T, n0 .. n0+R] = x[m0 .. m0+T] @ w[n0 .. n0+R]^T + bias, rounded to bfloat16.
template <int R, int T>
inline void block(const uint16_t* w, int64_t K, const float* x, const float* bias, int64_t n0,
                  int64_t m0, int64_t N, uint16_t* out) {
  float res[R * T];
  tile<R, T>(w, K, x + m0 * K, res);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      out[(m0 + t) * N + n0 + r] = float_to_bf16(res[t * R + r] + (bias ? bias[n0 + r] : 0.f));
}

// One group of kGroup weight rows against all M tokens: blocks of 4 tokens, then the 1-3 left,
// each tile shape keeping about 8 independent accumulators busy (FMA latency x 2 pipes).
void group(const uint16_t* w, int64_t K, const float* x, int64_t M, const float* bias, int64_t n0,
           int64_t N, uint16_t* out) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int r = 0; r < kGroup; r += 2) block<2, 4>(w + r * K, K, x, bias, n0 + r, m, N, out);
  switch (M - m) {
    case 3:
      for (int r = 0; r < kGroup; r += 2) block<2, 3>(w + r * K, K, x, bias, n0 + r, m, N, out);
      break;
    case 2:
      for (int r = 0; r < kGroup; r += 4) block<4, 2>(w + r * K, K, x, bias, n0 + r, m, N, out);
      break;
    case 1:
      for (int r = 0; r < kGroup; r += 4) block<4, 1>(w + r * K, K, x, bias, n0 + r, m, N, out);
      break;
  }
}

}  // namespace

// x: [M, K] bfloat16, weight: [N, K] bfloat16 contiguous, bias: [N] or None -> [M, N] bfloat16.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "linear: bfloat16 tensors expected");
  TORCH_CHECK(weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "linear: contiguous CPU weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  // float32 activations, each 16-wide chunk reordered to its even then its odd elements
  auto xf = x.to(torch::kFloat).contiguous();
  const int64_t K16 = K & ~int64_t(15);
  if (K16 > 0) {
    auto head = xf.narrow(1, 0, K16).reshape({M, K16 / 16, 8, 2}).transpose(2, 3).reshape({M, K16});
    xf = torch::cat({head, xf.narrow(1, K16, K - K16)}, 1).contiguous();
  }
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(torch::kFloat).contiguous();
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const auto* W = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* X = xf.data_ptr<float>();
  const int64_t groups = N / kGroup;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group(W + g * kGroup * K, K, X, M, b, g * kGroup, N, O);
  });
  for (int64_t n = groups * kGroup; n < N; ++n)  // rows left over: one at a time
    for (int64_t m = 0; m < M; ++m) block<1, 1>(W + n * K, K, X, b, n, m, N, O);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "bfloat16 linear for few tokens (AVX2 + FMA), batch invariant");
}
