// One 4-bit or 6-bit linear layer's call, as lean_layers.cpp hands it to linear_avx2.cpp's
// `linear_group` (several linears of the same activations in one parallel region).
#pragma once

#include <torch/extension.h>

#include <vector>

struct QuantizedCall {
  bool q6;                                   // 6-bit panels (else 4-bit)
  const std::vector<torch::Tensor>* weights;  // int4: panels, codes, steps; q6: lo, hi, sc, d
  int64_t n;                                 // outputs
  int64_t shift;                             // int4: log2 of the groups per block of steps
  const c10::optional<torch::Tensor>* bias;
};

std::vector<torch::Tensor> linear_group(const torch::Tensor& x,
                                        const std::vector<QuantizedCall>& calls);
