// Running MultiHeadAttention forward + backward on seeded data in any dtype and with any kernel, for
// the gradient and property tests: one LayerCase says the config, the input layout (batch first,
// sequence first, unbatched) and the masks; LayerData holds its numbers (float32-representable, so a
// float32 and a float64 layer see the same values); run_layer() returns out, weights and every
// gradient as host vectors (a head gate, when LayerData has one, included).
//
// Legend: B batch, L queries, S keys, E = d_model, h heads; S' = S + add_bias_kv + add_zero_attn.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/kernel_compare.hpp"
#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {

enum class InputLayout { BatchFirst, SequenceFirst, Unbatched };

struct LayerCase {
  std::string name;
  std::int64_t E = 6, h = 2, d_k = 0, d_v = 0, kdim = 0, vdim = 0;  // 0: the layer's defaults
  bool bias = true, add_bias_kv = false, add_zero_attn = false;
  double dropout = 0.0;
  InputLayout layout = InputLayout::BatchFirst;
  std::int64_t B = 2, L = 3, S = 4;  // B must be 1 when unbatched
  unsigned masks = 0;                // CompareMask bits (kernel_compare.hpp)
  bool causal = false;
  bool need_weights = true, average_attn_weights = true;

  std::int64_t dk() const { return d_k ? d_k : E / h; }
  std::int64_t dv() const { return d_v ? d_v : E / h; }
  std::int64_t kd() const { return kdim ? kdim : E; }
  std::int64_t vd() const { return vdim ? vdim : E; }
  std::int64_t extra() const { return (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0); }
};

inline void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

inline mha::MultiHeadAttentionConfig layer_config(const LayerCase& c, DType dtype) {
  mha::MultiHeadAttentionConfig cfg;
  cfg.d_model = c.E, cfg.num_heads = c.h, cfg.d_k = c.d_k, cfg.d_v = c.d_v, cfg.kdim = c.kdim, cfg.vdim = c.vdim;
  cfg.bias = c.bias, cfg.add_bias_kv = c.add_bias_kv, cfg.add_zero_attn = c.add_zero_attn;
  cfg.dropout = c.dropout;
  cfg.batch_first = c.layout != InputLayout::SequenceFirst;
  cfg.dtype = dtype;
  return cfg;
}

// The shape of an input with T positions and `width` features in the case's layout.
inline Shape input_shape(const LayerCase& c, std::int64_t T, std::int64_t width) {
  switch (c.layout) {
    case InputLayout::BatchFirst: return {c.B, T, width};
    case InputLayout::SequenceFirst: return {T, c.B, width};
    case InputLayout::Unbatched: return {T, width};
  }
  return {};
}

// The row (position t of batch b) of an input with T positions, counted in rows of the tensor.
inline std::int64_t input_row(const LayerCase& c, std::int64_t T, std::int64_t b, std::int64_t t) {
  switch (c.layout) {
    case InputLayout::BatchFirst: return b * T + t;
    case InputLayout::SequenceFirst: return t * c.B + b;
    case InputLayout::Unbatched: return t;
  }
  return 0;
}

struct LayerData {
  std::vector<double> query, key, value, dout;        // in the shapes input_shape() gives
  std::map<std::string, std::vector<double>> params;  // by parameter name
  std::map<std::string, Shape> param_shapes;
  NaiveMaskSpec masks;  // over the S input keys (B, h, L, S set)
  // The head gate: head_gate_shape [h] or [B, h] (empty: no gate), values in C order, passed as
  // head_gate_dtype; its gradient comes back as grads["head_gate"].
  std::vector<double> head_gate;
  Shape head_gate_shape;
  DType head_gate_dtype = DType::Float64;
};

inline LayerData make_layer_data(const LayerCase& c, std::uint64_t seed) {
  Rng rng(seed);
  LayerData d;
  const RandomState state = random_state(c.E, c.h, c.dk(), c.dv(), c.kd(), c.vd(), c.bias, c.add_bias_kv,
                                         c.add_zero_attn, DType::Float32, rng);
  for (const auto& [name, t] : state.tensors) {
    d.params[name] = to_doubles(t);
    d.param_shapes[name] = t.shape();
  }
  d.query = rounded_to(DType::Float32, random_values(c.B * c.L * c.E, rng));
  d.key = rounded_to(DType::Float32, random_values(c.B * c.S * c.kd(), rng));
  d.value = rounded_to(DType::Float32, random_values(c.B * c.S * c.vd(), rng));
  d.dout = rounded_to(DType::Float32, random_values(c.B * c.L * c.E, rng));

  // The masks, drawn as in the kernel tests (rows with no allowed key included).
  KernelCase k;
  k.seed = seed ^ 0x3a5cULL;
  k.B = c.B, k.h = c.h, k.L = c.L, k.S = c.S;
  k.masks = c.masks;
  k.causal = c.causal;
  d.masks = make_case_data(k).masks;
  return d;
}

struct LayerRun {
  std::vector<double> out, weights;
  std::map<std::string, std::vector<double>> grads;  // "query", "key", "value" and every parameter
};

// Masks as the layer takes them, owning their storage.
struct LayerMasks {
  mha::MultiHeadAttentionInputs inputs;
  std::vector<Tensor> storage;
};

inline LayerMasks layer_masks(const LayerCase& c, const NaiveMaskSpec& m, DType dtype) {
  LayerMasks out;
  mha::MultiHeadAttentionInputs& in = out.inputs;
  in.causal = c.causal;
  in.need_weights = c.need_weights;
  in.average_attn_weights = c.average_attn_weights;
  in.key_lengths = m.key_lengths;
  if (!m.key_padding.empty()) {
    const Shape shape = c.layout == InputLayout::Unbatched ? Shape{c.S} : Shape{c.B, c.S};
    out.storage.push_back(
        make_tensor(DType::Bool, shape, std::vector<double>(m.key_padding.begin(), m.key_padding.end())));
    in.key_padding_mask = out.storage.back().view();
  }
  if (!m.bool_mask.empty()) {
    const Shape shape = m.bool_mask_batched ? Shape{c.B * c.h, c.L, c.S} : Shape{c.L, c.S};
    out.storage.push_back(make_tensor(DType::Bool, shape, std::vector<double>(m.bool_mask.begin(), m.bool_mask.end())));
    in.attn_mask = out.storage.back().view();
  }
  if (!m.float_mask.empty()) {
    const Shape shape = m.float_mask_batched ? Shape{c.B * c.h, c.L, c.S} : Shape{c.L, c.S};
    out.storage.push_back(make_tensor(dtype, shape, m.float_mask));
    in.attn_mask = out.storage.back().view();
  }
  return out;
}

// A fresh layer (seed 7, so training-mode dropout draws the same mask every time) with the case's
// parameters, in `dtype`, with `kernel`: a training-mode forward and, when `backward`, the backward.
inline LayerRun run_layer(const LayerCase& c, const LayerData& d, DType dtype, mha::Kernel kernel, bool backward) {
  mha::MultiHeadAttention layer(layer_config(c, dtype), 7);
  layer.set_kernel(kernel);
  std::map<std::string, Tensor> params;
  std::map<std::string, TensorView> state;
  for (const auto& [name, values] : d.params) {
    params.emplace(name, make_tensor(dtype, d.param_shapes.at(name), values));
    state.emplace(name, params.at(name).view());
  }
  layer.load_state_dict(state);
  layer.train();
  const Tensor query = make_tensor(dtype, input_shape(c, c.L, c.E), d.query);
  const Tensor key = make_tensor(dtype, input_shape(c, c.S, c.kd()), d.key);
  const Tensor value = make_tensor(dtype, input_shape(c, c.S, c.vd()), d.value);
  LayerMasks masks = layer_masks(c, d.masks, dtype);
  if (!d.head_gate_shape.empty()) {
    masks.storage.push_back(make_tensor(d.head_gate_dtype, d.head_gate_shape, d.head_gate));
    masks.inputs.head_gate = masks.storage.back().view();
  }
  const mha::MultiHeadAttentionOutput r = layer.forward(query, key, value, masks.inputs);
  LayerRun run;
  EXPECT_EQ(r.out.shape(), input_shape(c, c.L, c.E));
  run.out = to_doubles(r.out);
  if (c.need_weights) run.weights = to_doubles(r.weights);
  if (backward) {
    const mha::MultiHeadAttentionGradients g = layer.backward(make_tensor(dtype, r.out.shape(), d.dout));
    EXPECT_EQ(g.query.shape(), query.shape());
    EXPECT_EQ(g.key.shape(), key.shape());
    EXPECT_EQ(g.value.shape(), value.shape());
    run.grads["query"] = to_doubles(g.query);
    run.grads["key"] = to_doubles(g.key);
    run.grads["value"] = to_doubles(g.value);
    for (const auto& [name, t] : g.parameters) {
      EXPECT_EQ(t.shape(), d.param_shapes.at(name)) << name;
      run.grads[name] = to_doubles(t);
    }
    EXPECT_EQ(g.parameters.size(), d.params.size());
    EXPECT_EQ(g.head_gate.defined(), !d.head_gate_shape.empty());
    if (g.head_gate.defined()) {
      EXPECT_EQ(g.head_gate.shape(), d.head_gate_shape);
      EXPECT_EQ(g.head_gate.dtype(), d.head_gate_dtype);
      run.grads["head_gate"] = to_doubles(g.head_gate);
    }
  }
  return run;
}

// The values a gradient name refers to in LayerData (an input or a parameter).
inline std::vector<double>& layer_values(LayerData& d, const std::string& name) {
  if (name == "query") return d.query;
  if (name == "key") return d.key;
  if (name == "value") return d.value;
  if (name == "head_gate") return d.head_gate;
  return d.params.at(name);
}

}  // namespace mha_test
