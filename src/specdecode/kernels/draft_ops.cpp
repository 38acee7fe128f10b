// The small operations of a Llama-style decoder layer for a few tokens, fused: what the lean
// forward (`lean.py`) runs between its linear layers. Built into the same
// extension as linear_avx2.cpp (whose module exports them).
//
// Why: through PyTorch, one token's RMSNorm is about eight operations and rotary embedding, the
// cache write and attention another fifteen, each dispatched on its own; a 24-layer draft spent
// nearly half as long in them as in its linears (docs/results.md).
// Here each is one call.
//
// Rounding follows Hugging Face's bfloat16 forward where it rounds (the residual sum, the
// normalized row before the norm's weight, the norm's output, SiLU's output and the gated
// product of the MLP); rotary embedding and attention run in float32 (the cache holds float32
// keys and values).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernel_common.h"
#include "kernel_ops.h"

#ifndef SD_UNROLL
#define SD_UNROLL _Pragma("GCC unroll 16")
#endif

namespace {

using specdecode_kernels::bf16_to_float;
using specdecode_kernels::float_to_bf16;
using specdecode_kernels::lane_sum;

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// e^x for x <= 0 (softmax after subtracting the maximum); 0 below -87 (as float32 underflows).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial for e^r:
// relative error about 2e-7.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float exp_nonpositive(float x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, exp_nonpositive(_mm256_set1_ps(x)));
  return lanes[0];
}

// out[i] = x[i] cos[i] + rotate_half(x)[i] sin[i], rotate_half(x) = (-x[d/2:], x[:d/2])
inline void rope(const uint16_t* x, const float* cos, const float* sin, float factor, int64_t d,
                 float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16_to_float(x[i]), b = bf16_to_float(x[i + half]);
    out[i] = (a * cos[i] - b * sin[i]) * factor;
    out[i + half] = (b * cos[i + half] + a * sin[i + half]) * factor;
  }
}

// 8 bfloat16 -> float32
inline __m256 load_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// float32 -> bfloat16 bit patterns in the 32-bit lanes, rounded as float_to_bf16 rounds
inline __m256i bf16_bits(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

inline __m256 round_bf16(__m256 f) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(f), 16));
}

inline void store_bf16(uint16_t* p, __m256 f) {
  const __m256i packed = _mm256_packus_epi32(bf16_bits(f), _mm256_setzero_si256());
  // packus works per 128-bit lane: the 4 + 4 results sit in 64-bit elements 0 and 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0b1000)));
}

// SiLU x / (1 + e^-x) with t = e^-|x| <= 1: x / (1 + t) for x >= 0, x t / (1 + t) below.
// t flushes to 0 below x = -87 (exp_nonpositive), so SiLU gives -0 there where PyTorch still
// gives numbers under 1e-36; above, the bfloat16 results equal PyTorch's (tests).
inline __m256 silu(__m256 x) {
  const __m256 negative_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 t = exp_nonpositive(negative_abs);
  const __m256 below = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, t), below);
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.device().is_cpu(),
              what, ": a contiguous bfloat16 CPU tensor expected");
}

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), what,
              ": a contiguous float32 CPU tensor expected");
}

}  // namespace

// x [n, D] bfloat16 (+ delta [n, D]: the residual sum x + delta, rounded to bfloat16, is taken
// and returned), weight [D] bfloat16 -> (x or x + delta, RMSNorm of it) as Hugging Face computes
// it: weight * bf16(x / sqrt(mean(x^2) + eps)), the mean in float32.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x,
                                                      c10::optional<torch::Tensor> delta,
                                                      torch::Tensor weight, double eps) {
  check_bf16(x, "add_rms_norm x");
  check_bf16(weight, "add_rms_norm weight");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1), "add_rms_norm: x [n, D], weight [D]");
  const int64_t n = x.size(0), D = x.size(1);
  torch::Tensor sum = x;
  if (delta.has_value()) {
    check_bf16(*delta, "add_rms_norm delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "add_rms_norm: delta must have x's shape");
    sum = torch::empty_like(x);
    const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const auto* b = reinterpret_cast<const uint16_t*>(delta->data_ptr<at::BFloat16>());
    auto* s = reinterpret_cast<uint16_t*>(sum.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < n * D; ++i) s[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
  }
  torch::Tensor out = torch::empty_like(x);
  const auto* s = reinterpret_cast<const uint16_t*>(sum.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<float> row(D);
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* in = s + t * D;
    float squares = 0.0f;
    for (int64_t i = 0; i < D; ++i) {
      row[i] = bf16_to_float(in[i]);
      squares += row[i] * row[i];
    }
    const float inv = 1.0f / std::sqrt(squares / float(D) + float(eps));
    for (int64_t i = 0; i < D; ++i)
      o[t * D + i] = float_to_bf16(bf16_to_float(w[i]) * round_bf16(row[i] * inv));
  }
  return {sum, out};
}

// The same over a float32 residual stream (the quantized targets' forward keeps its hidden states
// in float32, as llama.cpp does): x [n, D] float32 (+ delta [n, D] bfloat16, a linear's output;
// the sum stays float32), weight [D] bfloat16 -> (x or x + delta, bf16(weight * x / sqrt(mean(x^2)
// + eps))): one rounding, at the linears' input.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_f32(torch::Tensor x,
                                                          c10::optional<torch::Tensor> delta,
                                                          torch::Tensor weight, double eps) {
  check_f32(x, "add_rms_norm_f32 x");
  check_bf16(weight, "add_rms_norm_f32 weight");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1),
              "add_rms_norm_f32: x [n, D], weight [D]");
  const int64_t n = x.size(0), D = x.size(1);
  torch::Tensor sum = x;
  if (delta.has_value()) {
    check_bf16(*delta, "add_rms_norm_f32 delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "add_rms_norm_f32: delta must have x's shape");
    sum = torch::empty_like(x);
    const float* a = x.data_ptr<float>();
    const auto* b = reinterpret_cast<const uint16_t*>(delta->data_ptr<at::BFloat16>());
    float* s = sum.data_ptr<float>();
    for (int64_t i = 0; i < n * D; ++i) s[i] = a[i] + bf16_to_float(b[i]);
  }
  torch::Tensor out = torch::empty({n, D}, weight.options());
  const float* s = sum.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < n; ++t) {
    const float* in = s + t * D;
    float squares = 0.0f;
    for (int64_t i = 0; i < D; ++i) squares += in[i] * in[i];
    const float inv = 1.0f / std::sqrt(squares / float(D) + float(eps));
    for (int64_t i = 0; i < D; ++i) o[t * D + i] = float_to_bf16(bf16_to_float(w[i]) * (in[i] * inv));
  }
  return {sum, out};
}

// One attention block of a decoder layer for n new tokens after `past` cached ones:
// q [n, H * d], k and v [n, Hkv * d] bfloat16 (the projections' outputs); cos, sin [n, d]
// float32 (Hugging Face's rotary tables); keys, values [Hkv, capacity, d] float32, the layer's
// cache (rotated keys): positions past..past + n - 1 are written here; mask [n, past + n]
// float32 additive or None (then causal). Query head h reads key/value head h / (H / Hkv).
// Returns softmax(scale q k^T + mask) v as [n, H * d] bfloat16.
namespace {

// Attention of up to 8 queries (roped and scaled, [count][d]) that share one key/value head
// (keys, values [L][d]): query c sees keys 0 .. visible[c] - 1 with mask row masks[c] (or none)
// and writes out[c] [d] bfloat16; scores [8][L] is room. Each query's numbers are computed as it
// alone would compute them (its dot products one 8-lane FMA chain over d then lane_sum, plus the
// mask; its softmax sum in key order; its weighted values one FMA per key in key order), so a
// row's output does not depend on the other heads or tokens of the call: the queries of a chunk
// only share the reading of each key.
template <int C>
void dots(const float* queries, const float* keys, int64_t d, int64_t upto, float* scores,
          int64_t L) {
  const int64_t whole = d - d % 8;
  for (int64_t j = 0; j < upto; ++j) {
    const float* key = keys + j * d;
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256 k = _mm256_loadu_ps(key + i);
      for (int c = 0; c < C; ++c)
        acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(queries + c * d + i), k, acc[c]);
    }
    for (int c = 0; c < C; ++c) {
      float total = lane_sum(acc[c]);
      for (int64_t i = whole; i < d; ++i) total += queries[c * d + i] * key[i];
      scores[c * L + j] = total;
    }
  }
}

// out[0 .. 8 R) = bfloat16(inv * sum over keys j of row[j] values[j d + i]), one FMA per key in
// key order (keys of weight 0 skipped), the R sums of 8 in registers
template <int R>
inline void weighted_values(const float* row, int64_t visible, const float* values, int64_t d,
                            float inv, uint16_t* out) {
  __m256 acc[R];
  SD_UNROLL for (int c = 0; c < R; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < visible; ++j) {
    const float p = row[j];
    if (p == 0.0f) continue;
    const __m256 pv = _mm256_set1_ps(p);
    const float* v = values + j * d;
    SD_UNROLL for (int c = 0; c < R; ++c) acc[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  SD_UNROLL for (int c = 0; c < R; ++c) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
    for (int e = 0; e < 8; ++e) out[8 * c + e] = float_to_bf16(lanes[e]);
  }
}

// One query's softmax over its scores row [visible] (mask added) and its weighted sum of values.
void softmax_values(float* row, int64_t visible, const float* mask, const float* values,
                    int64_t d, uint16_t* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    row[j] = row[j] + (mask ? mask[j] : 0.0f);
    top = std::max(top, row[j]);
  }
  int64_t j = 0;
  for (; j + 8 <= visible; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&row[j]), _mm256_set1_ps(top)));
    _mm256_storeu_ps(&row[j], e);
  }
  for (; j < visible; ++j) row[j] = exp_nonpositive(row[j] - top);
  float total = 0.0f;
  for (j = 0; j < visible; ++j) total += row[j];
  const float inv = 1.0f / total;
  // 64 (else 32) of d at a time, their sums in 8 (4) registers: independent FMA chains enough
  // to keep the units busy, each element's sum still one FMA per key in key order
  int64_t i0 = 0;
  for (; i0 + 64 <= d; i0 += 64) weighted_values<8>(row, visible, values + i0, d, inv, out + i0);
  for (; i0 + 32 <= d; i0 += 32) weighted_values<4>(row, visible, values + i0, d, inv, out + i0);
  const int64_t whole = i0;
  for (int64_t i = whole; i < d; ++i) {  // d not a multiple of 32: the rest one by one
    float acc = 0.0f;
    for (j = 0; j < visible; ++j)
      if (row[j] != 0.0f) acc = std::fma(row[j], values[j * d + i], acc);
    out[i] = float_to_bf16(acc * inv);
  }
}

void attend_chunk(const float* queries, int64_t count, const int64_t* visible,
                  const float* const* masks, const float* keys, const float* values, int64_t d,
                  float* scores, int64_t L, uint16_t* const* outs) {
  const int64_t upto = *std::max_element(visible, visible + count);
  specdecode_kernels::with_tile_rows<8>(count, [&](auto c) {
    dots<decltype(c)::value>(queries, keys, d, upto, scores, L);
  });
  for (int64_t c = 0; c < count; ++c)
    softmax_values(scores + c * L, visible[c], masks[c], values, d, outs[c]);
}

}  // namespace

torch::Tensor rope_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                             torch::Tensor sin, torch::Tensor keys, torch::Tensor values,
                             int64_t past, c10::optional<torch::Tensor> mask, double scale) {
  check_f32(keys, "rope_attention keys");
  check_f32(values, "rope_attention values");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.is_contiguous() &&
                  values.is_contiguous() && keys.size(2) == cos.size(-1),
              "keys, values [Hkv, cap, d]");
  const int64_t n = q.size(0), L = past + n;
  TORCH_CHECK(past >= 0 && L <= keys.size(1), "rope_attention: the cache has no room for n tokens");
  const float* m = nullptr;
  if (mask.has_value()) {
    check_f32(*mask, "rope_attention mask");
    TORCH_CHECK(mask->size(0) == n && mask->size(1) == L, "rope_attention: mask [n, past + n]");
    m = mask->data_ptr<float>();
  }
  const SequenceCache cache{keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(1), past,
                            m};
  return rope_attention_rows(q, k, v, cos, sin, {cache}, {0, n}, keys.size(0), scale);
}

torch::Tensor rope_attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                  torch::Tensor cos, torch::Tensor sin,
                                  const std::vector<SequenceCache>& caches,
                                  const std::vector<int64_t>& bounds, int64_t kv_heads,
                                  double scale) {
  check_bf16(q, "rope_attention q");
  check_bf16(k, "rope_attention k");
  check_bf16(v, "rope_attention v");
  check_f32(cos, "rope_attention cos");
  check_f32(sin, "rope_attention sin");
  const size_t B = caches.size();
  TORCH_CHECK(B > 0 && bounds.size() == B + 1 && bounds[0] == 0 && bounds[B] == q.size(0),
              "rope_attention: bounds [0, ..., rows], one cache per sequence");
  const int64_t rows = q.size(0), d = cos.size(1);
  TORCH_CHECK(d % 2 == 0 && q.size(1) % (kv_heads * d) == 0 && k.size(0) == rows &&
                  k.size(1) == kv_heads * d && v.sizes() == k.sizes(),
              "rope_attention: q [n, H * d], k, v [n, Hkv * d] with H a multiple of Hkv");
  TORCH_CHECK(cos.size(0) == rows && sin.sizes() == cos.sizes(), "rope_attention: cos, sin [n, d]");
  const int64_t heads = q.size(1) / d, group = heads / kv_heads;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  torch::Tensor out = torch::empty({rows, heads * d}, q.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // each sequence's n x group queries of a key/value head (token-major) in near-equal chunks of
  // at most 8, one work item each (a chunk reads each key once for all its queries): the same
  // chunks as in a call of its own. Items [first_item[b], first_item[b + 1]) are sequence b's
  std::vector<int64_t> first_item(B + 1, 0), chunks(B);
  int64_t work = 0, longest = 0;
  for (size_t b = 0; b < B; ++b) {
    const int64_t n = bounds[b + 1] - bounds[b], L = caches[b].past + n;
    TORCH_CHECK(n >= 0, "rope_attention: bounds must not decrease");
    chunks[b] = (n * group + 7) / 8;
    first_item[b + 1] = first_item[b] + kv_heads * chunks[b];
    work += n * L * d * group;
    longest = std::max(longest, L);
  }
  // the new keys (rotated) and values into each cache
  for (size_t b = 0; b < B; ++b) {
    const SequenceCache& s = caches[b];
    for (int64_t row = bounds[b]; row < bounds[b + 1]; ++row) {
      const int64_t at = s.past + row - bounds[b];
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* key = s.keys + (h * s.capacity + at) * d;
        float* value = s.values + (h * s.capacity + at) * d;
        rope(kp + (row * kv_heads + h) * d, cp + row * d, sp + row * d, 1.0f, d, key);
        for (int64_t i = 0; i < d; ++i) value[i] = bf16_to_float(vp[(row * kv_heads + h) * d + i]);
      }
    }
  }
  const int64_t items = first_item[B];
  const int64_t grain = work < 65536 ? std::max<int64_t>(items, 1) : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(8 * d), scores(8 * longest);
    int64_t visible[8];
    const float* masks[8];
    uint16_t* outs[8];
    size_t b = 0;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[b + 1]) ++b;
      const SequenceCache& s = caches[b];
      const int64_t n = bounds[b + 1] - bounds[b], L = s.past + n, per_head = n * group;
      const int64_t kvh = (item - first_item[b]) / chunks[b];
      const int64_t chunk = (item - first_item[b]) % chunks[b];
      const int64_t first = chunk * per_head / chunks[b];
      const int64_t count = (chunk + 1) * per_head / chunks[b] - first;
      for (int64_t c = 0; c < count; ++c) {
        const int64_t t = (first + c) / group, h = kvh * group + (first + c) % group;
        const int64_t row = bounds[b] + t;
        rope(qp + (row * heads + h) * d, cp + row * d, sp + row * d, float(scale), d,
             queries.data() + c * d);
        visible[c] = s.mask ? L : s.past + t + 1;  // causal without a mask
        masks[c] = s.mask ? s.mask + t * L : nullptr;
        outs[c] = op + (row * heads + h) * d;
      }
      attend_chunk(queries.data(), count, visible, masks, s.keys + kvh * s.capacity * d,
                   s.values + kvh * s.capacity * d, d, scores.data(), L, outs);
    }
  });
  return out;
}

// The gated MLP activation silu(gate) * up for gate, up [n, I] bfloat16, rounded as Hugging
// Face's bfloat16 forward rounds it: SiLU's output to bfloat16, then the product.
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_bf16(gate, "silu_mul gate");
  check_bf16(up, "silu_mul up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up must have one shape");
  torch::Tensor out = torch::empty_like(gate);
  const auto* g = reinterpret_cast<const uint16_t*>(gate.data_ptr<at::BFloat16>());
  const auto* u = reinterpret_cast<const uint16_t*>(up.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t total = gate.numel(), blocks = total / 8;
  // element by element, so any split gives the same bits: threads for more than one row's worth
  // (a verification's rows), one thread for a token
  at::parallel_for(0, blocks, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t i = 8 * b0; i < 8 * b1; i += 8)
      store_bf16(o + i, _mm256_mul_ps(round_bf16(silu(load_bf16(g + i))), load_bf16(u + i)));
  });
  const int64_t i = 8 * blocks;
  if (i < total) {  // the tail through a padded block
    uint16_t gt[8] = {}, ut[8] = {}, ot[8];
    std::memcpy(gt, g + i, (total - i) * 2);
    std::memcpy(ut, u + i, (total - i) * 2);
    store_bf16(ot, _mm256_mul_ps(round_bf16(silu(load_bf16(gt))), load_bf16(ut)));
    std::memcpy(o + i, ot, (total - i) * 2);
  }
  return out;
}

// Greedy decoding's argmax over the vocabulary, per row of logits x [R, V] (bfloat16 or float32,
// on the CPU) -> [R] int64, as torch.argmax(x, -1) gives it: the first index of the largest
// value, or of the first NaN where a row has one. PyTorch's own ran a row of a 151,936-token
// vocabulary far slower than a read of it (docs/results.md), up to
// three times per speculative step. Eight lanes of running maxima with their first indices (a
// strict comparison keeps the first), then the smallest index among the lanes that hold the
// maximum, then the tail one by one.
namespace {

// vec(i): x[i .. i + 8) as float32; one(i): x[i]
template <typename Vec, typename One>
int64_t argmax_row(const Vec& vec, const One& one, const int64_t V) {
  int64_t best = 0, i = 0;
  if (V >= 8) {
    __m256 top = vec(0), nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
    __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = where;
    const __m256i eight = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= V; i += 8) {
      at = _mm256_add_epi32(at, eight);
      const __m256 v = vec(i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 more = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
      top = _mm256_blendv_ps(top, v, more);
      where = _mm256_blendv_epi8(where, at, _mm256_castps_si256(more));
    }
    if (_mm256_movemask_ps(nan)) {  // a NaN before the tail: the first one is the answer
      for (int64_t j = 0; j < i; ++j)
        if (std::isnan(one(j))) return j;
    }
    alignas(32) float tops[8];
    alignas(32) int32_t idx[8];
    _mm256_store_ps(tops, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), where);
    best = idx[0];
    float best_value = tops[0];
    for (int l = 1; l < 8; ++l)
      if (tops[l] > best_value || (tops[l] == best_value && idx[l] < best)) {
        best_value = tops[l];
        best = idx[l];
      }
  } else {
    if (V == 0) return 0;
    if (std::isnan(one(0))) return 0;
    i = 1;
  }
  for (; i < V; ++i) {  // the tail: against the best so far
    const float v = one(i);
    if (std::isnan(v)) return i;
    if (v > one(best)) best = i;
  }
  return best;
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "argmax_rows: contiguous bfloat16 or float32 CPU x [R, V] expected");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: rows of at least one value expected");
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    if (x.scalar_type() == at::kFloat) {
      const float* row = x.data_ptr<float>() + r * V;
      o[r] = argmax_row([&](int64_t i) { return _mm256_loadu_ps(row + i); },
                        [&](int64_t i) { return row[i]; }, V);
    } else {
      const auto* row = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * V;
      o[r] = argmax_row([&](int64_t i) { return load_bf16(row + i); },
                        [&](int64_t i) { return bf16_to_float(row[i]); }, V);
    }
  }
  return out;
}
