// The lean forward's decoder layers in one call: the loop lean.py runs over a model's layers
// (residual add + RMSNorm, the q / k / v projections, rotary embedding + the cache write +
// attention, the output projection, add + RMSNorm, gate and up, SiLU * up, down), with the same
// kernel calls in the same order, so every output is the same bits as the loop in Python.
//
// Why: a one-token forward is some 12 kernel calls per layer, and each call from Python
// costs the interpreter, pybind11's argument conversion and a Python object for every tensor:
// for the 0.5B draft that was a large share of its forward, and the target pays it too
// (docs/results.md).
//
// `LinearOp` is one linear layer on specdecode's kernels (its packed weights and which kernel
// reads them): what `cpu_linear.direct_linear` hands to Python as the layer's call, and what the
// layer loop calls here. `LeanLayers` holds a model's layers, made once per cache.
#include <torch/extension.h>

#include <initializer_list>
#include <tuple>
#include <vector>

#include "kernel_ops.h"

namespace {

// Whether the layer loop runs a layer's q, k, v (and its gate, up) as one linear_group where
// they are all 4-bit or 6-bit; off for comparisons (`set_linear_groups`).
bool g_linear_groups = true;

// One linear layer on a kernel: `code` says which (its name in `kNames`), `w` holds its weights
// as that kernel takes them (rows: [weight]; panels: [panels]; int8: [panels, scale]; int4:
// [panels, codes, steps]; q6: [lo, hi, sc, d]), `n` its outputs.
struct LinearOp {
  enum Kind { kRows, kPanels, kInt8, kInt4, kQ6 };
  static constexpr const char* kNames[] = {"rows", "panels", "int8", "int4", "q6"};
  static constexpr size_t kTensors[] = {1, 1, 2, 3, 4};  // weight tensors per kind

  Kind code;
  std::vector<torch::Tensor> w;
  int64_t n;
  int64_t shift;  // int4 only: log2 of the groups per block of steps
  c10::optional<torch::Tensor> bias;

  LinearOp(const std::string& kind, std::vector<torch::Tensor> w_, int64_t n_, int64_t shift_,
           c10::optional<torch::Tensor> bias_)
      : code(parse(kind)), w(std::move(w_)), n(n_), shift(shift_), bias(std::move(bias_)) {
    TORCH_CHECK(w.size() == kTensors[code], "LinearOp: ", kind, " takes ", kTensors[code],
                " weight tensors, got ", w.size());
  }

  static Kind parse(const std::string& kind) {
    for (int i = 0; i <= kQ6; ++i)
      if (kind == kNames[i]) return static_cast<Kind>(i);
    TORCH_CHECK(false, "LinearOp: unknown kind ", kind, " (rows, panels, int8, int4, q6)");
  }

  std::string kind() const { return kNames[code]; }

  // x [M, K] contiguous bfloat16 -> [M, N] bfloat16
  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (code) {
      case kRows:
        return ::linear(x, w[0], bias);  // not at::linear, which ADL finds too
      case kPanels:
        return linear_packed(x, w[0], n, bias);
      case kInt8:
        return linear_int8_packed(x, w[0], n, w[1], bias);
      case kInt4:
        return linear_int4_packed(x, w[0], n, w[1], w[2], shift, bias);
      case kQ6:
        return linear_q6_packed(x, w[0], w[1], w[2], w[3], n, bias);
    }
    TORCH_CHECK(false, "LinearOp: bad kind");
  }

  bool quantized() const { return code == kInt4 || code == kQ6; }
  QuantizedCall call() const { return {code == kQ6, &w, n, shift, &bias}; }
};

// ops over the same x [M, K] -> their outputs: one linear_group where every op is 4-bit or
// 6-bit (and groups are on), else one call each
std::vector<torch::Tensor> apply_all(std::initializer_list<const LinearOp*> ops,
                                     const torch::Tensor& x) {
  bool group = g_linear_groups;
  for (const LinearOp* op : ops) group = group && op->quantized();
  if (group) {
    std::vector<QuantizedCall> calls;
    for (const LinearOp* op : ops) calls.push_back(op->call());
    return linear_group(x, calls);
  }
  std::vector<torch::Tensor> outs;
  for (const LinearOp* op : ops) outs.push_back((*op)(x));
  return outs;
}

// One decoder layer: its seven projections and its two RMSNorms' weights and epsilons.
struct LeanLayer {
  LinearOp q, k, v, o, gate, up, down;
  torch::Tensor input_norm, post_norm;
  double input_eps, post_eps;
};

// A model's decoder layers, run one after the other over the rows of one sequence.
class LeanLayers {
 public:
  LeanLayers(std::vector<LeanLayer> layers, double scale, bool wide)
      : layers_(std::move(layers)), scale_(scale), wide_(wide) {
    TORCH_CHECK(!layers_.empty(), "LeanLayers: no layers");
  }

  // x [N, D] the embedded rows of every sequence, one after the other (sequence b's rows
  // bounds[b]:bounds[b + 1]), the residual stream (float32 when `wide`, else bfloat16); kvs[b]
  // sequence b's cache [layers, 2, Hkv, capacity, d] float32, its first pasts[b] positions
  // valid; cos, sin [N, d] float32; masks[b] [n_b, past_b + n_b] additive float32 or none
  // (causal). Writes each sequence's new keys and values after its past and returns (x, delta)
  // after the last layer: its residual stream and its MLP's output, not yet added; and the
  // residual stream entering each layer of `taps` (increasing indices; an EAGLE-3 head's hidden
  // states). The projections run over all N rows at once; each sequence attends over its own
  // cache (one parallel region for all of them), row for row the bits of its own forward.
  std::tuple<torch::Tensor, torch::Tensor, std::vector<torch::Tensor>> forward(
      torch::Tensor x, const std::vector<torch::Tensor>& kvs, const std::vector<int64_t>& pasts,
      const torch::Tensor& cos, const torch::Tensor& sin,
      const std::vector<c10::optional<torch::Tensor>>& masks, const std::vector<int64_t>& bounds,
      const std::vector<int64_t>& taps) const {
    const size_t B = kvs.size();
    TORCH_CHECK(B > 0 && pasts.size() == B && masks.size() == B && bounds.size() == B + 1 &&
                    bounds[0] == 0 && bounds[B] == x.size(0),
                "LeanLayers: one cache, past and mask per sequence, bounds [0, ..., rows]");
    // each sequence's cache as rope_attention_rows takes it, its keys and values pointed at
    // layer i's in the loop (kv holds layer after layer, each keys then values)
    std::vector<SequenceCache> caches(B);
    std::vector<float*> bases(B);
    const torch::Tensor& first = kvs[0];
    TORCH_CHECK(first.dim() == 5 && first.size(0) == int64_t(layers_.size()) &&
                    first.size(1) == 2 && first.size(4) == cos.size(-1),
                "LeanLayers: kv [layers, 2, Hkv, capacity, d] expected");
    const int64_t kv_heads = first.size(2), d = first.size(4);
    for (size_t b = 0; b < B; ++b) {
      const torch::Tensor& kv = kvs[b];
      TORCH_CHECK(kv.dim() == 5 && kv.size(0) == first.size(0) && kv.size(1) == 2 &&
                      kv.size(2) == kv_heads && kv.size(4) == d && kv.is_contiguous() &&
                      kv.scalar_type() == torch::kFloat32,
                  "LeanLayers: each kv [layers, 2, Hkv, capacity, d] float32, contiguous");
      const int64_t n = bounds[b + 1] - bounds[b];
      TORCH_CHECK(n >= 0 && pasts[b] >= 0 && pasts[b] + n <= kv.size(3),
                  "LeanLayers: a cache has no room for its new rows");
      const float* m = nullptr;
      if (masks[b].has_value()) {
        const torch::Tensor& mask = *masks[b];
        TORCH_CHECK(mask.scalar_type() == torch::kFloat32 && mask.is_contiguous() &&
                        mask.dim() == 2 && mask.size(0) == n && mask.size(1) == pasts[b] + n,
                    "LeanLayers: a mask [n, past + n] float32");
        m = mask.data_ptr<float>();
      }
      bases[b] = kv.data_ptr<float>();
      caches[b] = {nullptr, nullptr, kv.size(3), pasts[b], m};
    }
    const auto add_norm = wide_ ? add_rms_norm_f32 : add_rms_norm;
    c10::optional<torch::Tensor> delta;  // the last block's output, added to x by the next norm
    std::vector<torch::Tensor> tapped;
    size_t next_tap = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LeanLayer& layer = layers_[i];
      for (size_t b = 0; b < B; ++b) {  // this layer's keys, then values: [Hkv, capacity, d]
        const int64_t plane = kv_heads * caches[b].capacity * d;
        caches[b].keys = bases[b] + int64_t(i) * 2 * plane;
        caches[b].values = caches[b].keys + plane;
      }
      torch::Tensor h;
      std::tie(x, h) = add_norm(x, delta, layer.input_norm, layer.input_eps);
      if (next_tap < taps.size() && taps[next_tap] == int64_t(i)) {
        tapped.push_back(x);  // a fresh tensor: the next add writes a new one
        ++next_tap;
      }
      const auto qkv = apply_all({&layer.q, &layer.k, &layer.v}, h);
      const torch::Tensor out = rope_attention_rows(qkv[0], qkv[1], qkv[2], cos, sin, caches,
                                                    bounds, kv_heads, scale_);
      std::tie(x, h) = add_norm(x, layer.o(out), layer.post_norm, layer.post_eps);
      const auto gate_up = apply_all({&layer.gate, &layer.up}, h);
      delta = layer.down(silu_mul(gate_up[0], gate_up[1]));
    }
    return {x, *delta, tapped};
  }

  size_t size() const { return layers_.size(); }

 private:
  std::vector<LeanLayer> layers_;
  double scale_;  // attention's 1 / sqrt(d)
  bool wide_;     // a float32 residual stream (add_rms_norm_f32) rather than bfloat16
};

}  // namespace

void bind_lean_layers(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<LinearOp>(m, "LinearOp",
                       "one linear layer on specdecode's kernels: call it on x [M, K] bfloat16")
      .def(py::init<std::string, std::vector<torch::Tensor>, int64_t, int64_t,
                    c10::optional<torch::Tensor>>(),
           py::arg("kind"), py::arg("weights"), py::arg("n"), py::arg("shift"), py::arg("bias"))
      .def("__call__", &LinearOp::operator(), py::arg("x"))
      .def_property_readonly("kind", &LinearOp::kind)
      .def_readonly("n", &LinearOp::n);
  py::class_<LeanLayer>(m, "LeanLayer", "a decoder layer's projections and norms")
      .def(py::init<LinearOp, LinearOp, LinearOp, LinearOp, LinearOp, LinearOp, LinearOp,
                    torch::Tensor, torch::Tensor, double, double>(),
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("gate"), py::arg("up"),
           py::arg("down"), py::arg("input_norm"), py::arg("post_norm"), py::arg("input_eps"),
           py::arg("post_eps"));
  py::class_<LeanLayers>(m, "LeanLayers", "a model's decoder layers, run in one call")
      .def(py::init<std::vector<LeanLayer>, double, bool>(), py::arg("layers"),
           py::arg("scale"), py::arg("wide"))
      .def("forward", &LeanLayers::forward, py::arg("x"), py::arg("kvs"), py::arg("pasts"),
           py::arg("cos"), py::arg("sin"), py::arg("masks"), py::arg("bounds"),
           py::arg("taps") = std::vector<int64_t>{})
      .def("__len__", &LeanLayers::size);
  m.def(
      "linear_group",
      [](const torch::Tensor& x, const std::vector<LinearOp>& ops) {
        std::vector<QuantizedCall> calls;
        for (const LinearOp& op : ops) {
          TORCH_CHECK(op.quantized(), "linear_group: 4-bit and 6-bit linears only, got ",
                      op.kind());
          calls.push_back(op.call());
        }
        return linear_group(x, calls);
      },
      "the outputs of several 4-bit / 6-bit LinearOps over the same x [M, K], in one parallel "
      "region",
      py::arg("x"), py::arg("ops"));
  m.def(
      "set_linear_groups", [](bool on) { return g_linear_groups = on; },
      "whether the layer loop runs q, k, v (and gate, up) as one linear_group where it can");
}
