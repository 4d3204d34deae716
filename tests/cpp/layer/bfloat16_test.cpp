// MultiHeadAttention in bfloat16: parameters, outputs and gradients in bf16, against the float64 layer
// on the same (bf16-representable) numbers; determinism; bf16 files. The rule against PyTorch's own
// bf16 module is tests/python/test_bfloat16.py (PyTorch runs there); here the bound is derived from
// the rounding chain: an output passes through about five bf16 roundings (projection, P, attention
// output, output projection, and the inputs' own), each of relative 2^-9 on values whose sums and
// products stay within a few units, so its error stays below 2^-5 of the result's largest magnitude;
// gradients pass through about twice as many (2^-4). A wrong product, a lost bias or a missing head
// moves results by their whole size, far beyond that.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "support/finite_differences.hpp"
#include "support/layer_harness.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

void round_to_bf16(std::vector<double>& values) { values = rounded_to(DType::BFloat16, std::move(values)); }

LayerData bf16_layer_data(const LayerCase& c, std::uint64_t seed) {
  LayerData d = make_layer_data(c, seed);
  for (auto* x : {&d.query, &d.key, &d.value, &d.dout, &d.masks.float_mask}) round_to_bf16(*x);
  for (auto& [name, values] : d.params) round_to_bf16(values);
  return d;
}

::testing::AssertionResult within(const std::string& what, const std::vector<double>& got,
                                  const std::vector<double>& want, double relative) {
  const double bound = relative * max_abs_finite(want) + 1e-6;
  const MaxError e = max_abs_error(got, want);
  if (e.value <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": error " << e.value << " at " << e.at << " > " << bound;
}

std::vector<LayerCase> cases() {
  std::vector<LayerCase> out;
  auto add = [&](std::string name, auto edit) {
    LayerCase c;
    c.name = std::move(name);
    c.E = 64, c.h = 4, c.B = 2, c.L = 37, c.S = 150;
    edit(c);
    out.push_back(c);
  };
  add("self_causal", [](LayerCase& c) { c.S = c.L = 140, c.causal = true; });
  add("cross_key_padding_float_mask", [](LayerCase& c) { c.masks = kCmpKeyPadding | kCmpFloat2d; });
  add("kdim_vdim_dk_dv_bool3d",
      [](LayerCase& c) { c.kdim = 24, c.vdim = 40, c.d_k = 59, c.d_v = 13, c.masks = kCmpBool3d; });
  add("bias_kv_zero_attn_sequence_first", [](LayerCase& c) {
    c.add_bias_kv = c.add_zero_attn = true, c.layout = InputLayout::SequenceFirst, c.masks = kCmpLengths;
  });
  add("unbatched_no_bias_per_head_weights",
      [](LayerCase& c) { c.layout = InputLayout::Unbatched, c.B = 1, c.bias = false, c.average_attn_weights = false; });
  add("h1_d128_across_tiles", [](LayerCase& c) { c.E = 128, c.h = 1, c.L = 130, c.S = 300; });
  return out;
}

class Bfloat16Layer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(Bfloat16Layer, OutputsAndGradientsNearFloat64) {
  const LayerCase& c = GetParam();
  const LayerData d = bf16_layer_data(c, name_seed(c.name));
  const LayerRun got = run_layer(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  const LayerRun want = run_layer(c, d, DType::Float64, mha::Kernel::Reference, true);
  EXPECT_TRUE(within("out", got.out, want.out, 0x1.0p-5));
  EXPECT_TRUE(within("weights", got.weights, want.weights, 0x1.0p-5));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (const auto& [name, grad] : want.grads) EXPECT_TRUE(within(name, got.grads.at(name), grad, 0x1.0p-4));
}

INSTANTIATE_TEST_SUITE_P(Cases, Bfloat16Layer, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

TEST(Bfloat16LayerTypes, ParametersOutputsAndGradientsAreBfloat16) {
  mha::MultiHeadAttentionConfig cfg;
  cfg.d_model = 16, cfg.num_heads = 2, cfg.dtype = DType::BFloat16;
  mha::MultiHeadAttention layer(cfg, 1);
  for (const std::string& name : layer.parameter_names()) EXPECT_EQ(layer.parameter(name).dtype(), DType::BFloat16);
  Rng rng(3);
  const Tensor x = Tensor::copy_of(random_tensor(DType::Float32, {2, 5, 16}, rng), DType::BFloat16);
  layer.train();
  mha::MultiHeadAttentionInputs in;
  in.need_weights = true;
  const auto r = layer.forward(x, x, x, in);
  EXPECT_EQ(r.out.dtype(), DType::BFloat16);
  EXPECT_EQ(r.weights.dtype(), DType::BFloat16);
  const auto g = layer.backward(r.out);
  EXPECT_EQ(g.query.dtype(), DType::BFloat16);
  for (const auto& [name, t] : g.parameters) EXPECT_EQ(t.dtype(), DType::BFloat16) << name;
  // Inputs of another dtype are refused, naming both.
  const Tensor x32 = random_tensor(DType::Float32, {2, 5, 16}, rng);
  try {
    (void)layer.forward(x32, x32, x32);
    FAIL() << "float32 inputs reached a bfloat16 layer";
  } catch (const mha::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("bfloat16"), std::string::npos) << what;
    EXPECT_NE(what.find("float32"), std::string::npos) << what;
  }
}

TEST(Bfloat16LayerDeterminism, OneThreadVsTwoBitwise) {
  LayerCase c;
  c.name = "determinism", c.E = 64, c.h = 4, c.B = 2, c.L = 200, c.S = 200, c.causal = true;
  const LayerData d = bf16_layer_data(c, 11);
  const int before = mha::max_num_threads();
  mha::set_num_threads(1);
  const LayerRun one = run_layer(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  mha::set_num_threads(std::min(2, before));
  const LayerRun two = run_layer(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  mha::set_num_threads(before);
  EXPECT_EQ(one.out, two.out);
  for (const auto& [name, grad] : one.grads) EXPECT_EQ(grad, two.grads.at(name)) << name;
}

TEST(Bfloat16LayerFiles, SavedAsBf16AndLoadedBitwise) {
  mha::MultiHeadAttentionConfig cfg;
  cfg.d_model = 24, cfg.num_heads = 3, cfg.dtype = DType::BFloat16, cfg.add_bias_kv = true;
  const mha::MultiHeadAttention layer(cfg, 5);
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "mha_bf16_layer_test.safetensors";
  mha::save_safetensors(layer, path.string());
  const auto file = mha::read_safetensors(path.string());
  for (const auto& [name, t] : file.tensors) EXPECT_EQ(t.dtype(), DType::BFloat16) << name << " stored as BF16";
  const mha::MultiHeadAttention loaded = mha::load_multi_head_attention(path.string());
  std::filesystem::remove(path);
  EXPECT_EQ(loaded.config().dtype, DType::BFloat16);
  for (const std::string& name : layer.parameter_names())
    EXPECT_TRUE(bitwise_equal(Tensor::copy_of(loaded.parameter(name)), Tensor::copy_of(layer.parameter(name)))) << name;
}

}  // namespace
}  // namespace mha_test
