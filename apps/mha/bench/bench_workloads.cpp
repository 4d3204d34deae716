// The attention core and the whole layer as `mha bench` times them.
//
// Legend: B batch, h heads, N = L = S, d per-head width, E = d_model.
#include "bench/bench_workloads.hpp"

#include <random>
#include <stdexcept>

namespace mha_cli::bench {

mha::Tensor random_tensor(mha::Shape shape, unsigned seed) {
  mha::Tensor t(mha::DType::Float32, std::move(shape));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = uniform(rng);
  return t;
}

const char* pass_name(Pass pass) { return pass == Pass::Forward ? "fwd" : "fwdbwd"; }

Pass parse_pass(const std::string& name) {
  if (name == "fwd") return Pass::Forward;
  if (name == "fwdbwd") return Pass::ForwardBackward;
  throw std::invalid_argument("pass: expected fwd or fwdbwd, got " + name);
}

double attention_forward_flops(std::int64_t B, std::int64_t h, std::int64_t N, std::int64_t d, bool causal) {
  const double full =
      4.0 * static_cast<double>(B * h) * static_cast<double>(N) * static_cast<double>(N) * static_cast<double>(d);
  return causal ? full / 2 : full;
}

double layer_flops(std::int64_t B, std::int64_t N, std::int64_t E, std::int64_t h, bool causal, Pass pass) {
  const double projections = 2.0 * static_cast<double>(B * N) * static_cast<double>(E) * static_cast<double>(4 * E);
  const double attention = attention_forward_flops(B, h, N, E / h, causal);
  if (pass == Pass::Forward) return projections + attention;
  return 3 * projections + (1 + kBackwardFlopsRatio) * attention;
}

CoreWorkload::CoreWorkload(std::int64_t B, std::int64_t h, std::int64_t N, std::int64_t d, bool causal,
                           bool with_backward, HeadLayout layout) {
  const bool interleaved = layout == HeadLayout::Interleaved;
  const mha::Shape storage = interleaved ? mha::Shape{B, N, h, d} : mha::Shape{B, h, N, d};
  const mha::Shape strides = interleaved ? mha::Shape{N * h * d, d, h * d, 1} : mha::contiguous_strides({B, h, N, d});
  auto make = [&](unsigned seed, mha::Tensor& t, mha::TensorView& view) {
    t = random_tensor(storage, seed);
    view = mha::TensorView(t.data(), mha::DType::Float32, {B, h, N, d}, strides);
  };
  make(1, q_, q_view_);
  make(2, k_, k_view_);
  make(3, v_, v_view_);
  if (with_backward) make(4, dout_, dout_view_);
  options_.causal = causal;
  options_.need_lse = true;  // the backward recomputes the weights from the log-sum-exp
  options_.kernel = mha::Kernel::Flash;
}

void CoreWorkload::forward() {
  result_ = {};  // the previous call's outputs are freed first, as in a training loop
  result_ = mha::scaled_dot_product_attention(q_view_, k_view_, v_view_, options_);
}

void CoreWorkload::backward() {
  if (!result_.out.defined() || !dout_.defined())
    throw std::logic_error("CoreWorkload::backward without with_backward or before forward");
  // The gradients are new tensors, freed at the end of the statement, as a training step would.
  mha::scaled_dot_product_attention_backward(dout_view_, q_view_, k_view_, v_view_, result_.out, result_.lse, options_);
}

LayerWorkload::LayerWorkload(std::int64_t B, std::int64_t N, std::int64_t E, std::int64_t h, bool causal, Pass pass,
                             mha::DType dtype)
    : pass_(pass),
      module_(mha::MultiHeadAttentionConfig{.d_model = E, .num_heads = h, .batch_first = true, .dtype = dtype}, 0),
      x_(mha::Tensor::copy_of(random_tensor({B, N, E}, 5), dtype)) {
  inputs_.causal = causal;
  inputs_.need_weights = false;
  if (pass == Pass::Forward) {
    module_.eval();
  } else {
    module_.train();  // dropout is 0: training mode only makes forward() keep what backward() needs
    dout_ = mha::Tensor::copy_of(random_tensor({B, N, E}, 6), dtype);
  }
}

void LayerWorkload::run() {
  module_.forward(x_, x_, x_, inputs_);
  if (pass_ == Pass::ForwardBackward) module_.backward(dout_);
}

}  // namespace mha_cli::bench
