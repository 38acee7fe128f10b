// The extension's tensor functions that its source files call across one another, declared once:
// linear_avx2.cpp's linears (and linear_group, several 4-bit / 6-bit linears of the same x in
// one parallel region), draft_ops.cpp's fused small operations. lean_layers.cpp's layer loop
// calls both; linear_avx2.cpp binds them all.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

// ---- linear_avx2.cpp ----
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor panels, int64_t N,
                            c10::optional<torch::Tensor> bias);
torch::Tensor linear_int8_packed(torch::Tensor x, torch::Tensor panels, int64_t N,
                                 torch::Tensor scale, c10::optional<torch::Tensor> bias);
torch::Tensor linear_int4_packed(torch::Tensor x, torch::Tensor panels, int64_t N,
                                 torch::Tensor codes, torch::Tensor steps, int64_t shift,
                                 c10::optional<torch::Tensor> bias);
torch::Tensor linear_q6_packed(torch::Tensor x, torch::Tensor lo, torch::Tensor hi,
                               torch::Tensor sc, torch::Tensor d, int64_t N,
                               c10::optional<torch::Tensor> bias);

// One 4-bit or 6-bit linear's weights, as linear_group takes them
struct QuantizedCall {
  bool q6;                                    // 6-bit panels (else 4-bit)
  const std::vector<torch::Tensor>* weights;  // int4: panels, codes, steps; q6: lo, hi, sc, d
  int64_t n;                                  // outputs
  int64_t shift;                              // int4: log2 of the groups per block of steps
  const c10::optional<torch::Tensor>* bias;
};

std::vector<torch::Tensor> linear_group(const torch::Tensor& x,
                                        const std::vector<QuantizedCall>& calls);

// ---- draft_ops.cpp: the lean forward's fused small operations ----
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x,
                                                      c10::optional<torch::Tensor> delta,
                                                      torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_f32(torch::Tensor x,
                                                          c10::optional<torch::Tensor> delta,
                                                          torch::Tensor weight, double eps);
torch::Tensor rope_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                             torch::Tensor sin, torch::Tensor keys, torch::Tensor values,
                             int64_t past, c10::optional<torch::Tensor> mask, double scale);
// One sequence's cache of one layer, as rope_attention_rows takes it: keys and values
// [Hkv, capacity, d] float32 (contiguous), the first `past` positions valid; `mask` its rows'
// additive float32 mask [n, past + n] or nullptr (causal).
struct SequenceCache {
  float* keys;
  float* values;
  int64_t capacity, past;
  const float* mask;
};
// rope_attention over several sequences' rows in one call (q, k, v, cos, sin: every sequence's
// rows one after the other, sequence b's bounds[b]:bounds[b + 1]); each sequence's output the
// same bits as its own call. The caches are the caller's to check.
torch::Tensor rope_attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                  torch::Tensor cos, torch::Tensor sin,
                                  const std::vector<SequenceCache>& caches,
                                  const std::vector<int64_t>& bounds, int64_t kv_heads,
                                  double scale);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
torch::Tensor argmax_rows(torch::Tensor x);
