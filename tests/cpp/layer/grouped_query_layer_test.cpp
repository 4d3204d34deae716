// MultiHeadAttention with num_kv_heads < num_heads (grouped-query attention): a layer with h_kv
// key/value heads equals, in float64, the plain multi-head layer (num_kv_heads = h) whose W^K and W^V
// (and their biases, bias_k and bias_v) repeat each key/value head's rows for the g = h / h_kv query
// heads of its group: the same outputs and weights, the same query/key/value and W^Q / W^O gradients,
// and W^K / W^V gradients that are the group sums of the repeated layer's. Also: the KV cache path,
// float32 against float64, save and load, and bad num_kv_heads.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads, h_kv key/value heads, g = h / h_kv.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "mha/io.hpp"
#include "mha/multi_head_attention.hpp"
#include "support/finite_differences.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;

struct GroupedLayerCase {
  const char* name;
  std::int64_t E, h, h_kv, d_k, d_v, kdim;
  bool bias, add_bias_kv, add_zero_attn, batch_first, causal;
};

void PrintTo(const GroupedLayerCase& c, std::ostream* os) { *os << c.name; }

const GroupedLayerCase kCases[] = {
    {"two_groups_of_two", 16, 4, 2, 0, 0, 0, true, false, false, true, false},
    {"multi_query_causal", 24, 6, 1, 0, 0, 0, true, false, false, false, true},
    {"bias_kv_zero_attn", 12, 4, 2, 3, 5, 7, true, true, true, true, false},
    {"no_bias_three_per_group", 18, 6, 2, 4, 4, 10, false, false, false, true, true},
};

MultiHeadAttentionConfig config_of(const GroupedLayerCase& c, std::int64_t h_kv, DType dtype) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = c.E, cfg.num_heads = c.h, cfg.num_kv_heads = h_kv, cfg.d_k = c.d_k, cfg.d_v = c.d_v;
  cfg.kdim = c.kdim, cfg.bias = c.bias, cfg.add_bias_kv = c.add_bias_kv, cfg.add_zero_attn = c.add_zero_attn;
  cfg.batch_first = c.batch_first, cfg.dtype = dtype;
  return cfg;
}

// Rows [h_kv * width, ...] -> [h * width, ...]: each key/value head's block of `width` rows repeated g times.
std::vector<double> repeat_row_blocks(const std::vector<double>& x, std::int64_t h_kv, std::int64_t g,
                                      std::int64_t width, std::int64_t row_length) {
  std::vector<double> out;
  const std::int64_t block = width * row_length;
  for (std::int64_t kv = 0; kv < h_kv; ++kv)
    for (std::int64_t m = 0; m < g; ++m) out.insert(out.end(), x.begin() + kv * block, x.begin() + (kv + 1) * block);
  return out;
}

// The inverse direction for gradients: [h * width, ...] -> [h_kv * width, ...], summing each group.
std::vector<double> sum_row_blocks(const std::vector<double>& x, std::int64_t h_kv, std::int64_t g, std::int64_t width,
                                   std::int64_t row_length) {
  const std::int64_t block = width * row_length;
  std::vector<double> out(static_cast<std::size_t>(h_kv * block), 0.0);
  for (std::int64_t head = 0; head < h_kv * g; ++head)
    for (std::int64_t n = 0; n < block; ++n)
      out[static_cast<std::size_t>(head / g * block + n)] += x[static_cast<std::size_t>(head * block + n)];
  return out;
}

// The plain multi-head layer computing what `grouped` computes.
MultiHeadAttention repeated_layer(const MultiHeadAttention& grouped, const GroupedLayerCase& c) {
  const MultiHeadAttentionConfig& gc = grouped.config();
  MultiHeadAttention plain(config_of(c, c.h, DType::Float64), 1);
  const std::int64_t g = gc.num_heads / gc.num_kv_heads, qk = gc.num_heads * gc.d_k;
  const std::int64_t kk = gc.num_kv_heads * gc.d_k, vk = gc.num_kv_heads * gc.d_v;
  const std::vector<double> wq = to_doubles(grouped.parameter("q_proj_weight"));
  const std::vector<double> wk =
      repeat_row_blocks(to_doubles(grouped.parameter("k_proj_weight")), gc.num_kv_heads, g, gc.d_k, gc.kdim);
  const std::vector<double> wv =
      repeat_row_blocks(to_doubles(grouped.parameter("v_proj_weight")), gc.num_kv_heads, g, gc.d_v, gc.vdim);
  if (plain.packed_in_proj()) {
    std::vector<double> packed = wq;
    packed.insert(packed.end(), wk.begin(), wk.end());
    packed.insert(packed.end(), wv.begin(), wv.end());
    plain.set_parameter("in_proj_weight",
                        make_tensor(DType::Float64, plain.parameter("in_proj_weight").shape(), packed));
  } else {
    plain.set_parameter("q_proj_weight", make_tensor(DType::Float64, {qk, gc.d_model}, wq));
    plain.set_parameter("k_proj_weight", make_tensor(DType::Float64, {gc.num_heads * gc.d_k, gc.kdim}, wk));
    plain.set_parameter("v_proj_weight", make_tensor(DType::Float64, {gc.num_heads * gc.d_v, gc.vdim}, wv));
  }
  if (gc.bias) {
    const std::vector<double> b = to_doubles(grouped.parameter("in_proj_bias"));
    std::vector<double> packed(b.begin(), b.begin() + qk);
    const std::vector<double> bk =
        repeat_row_blocks({b.begin() + qk, b.begin() + qk + kk}, gc.num_kv_heads, g, gc.d_k, 1);
    const std::vector<double> bv = repeat_row_blocks({b.begin() + qk + kk, b.end()}, gc.num_kv_heads, g, gc.d_v, 1);
    packed.insert(packed.end(), bk.begin(), bk.end());
    packed.insert(packed.end(), bv.begin(), bv.end());
    plain.set_parameter("in_proj_bias", make_tensor(DType::Float64, plain.parameter("in_proj_bias").shape(), packed));
    plain.set_parameter("out_proj.bias", grouped.parameter("out_proj.bias"));
  }
  if (gc.add_bias_kv) {
    plain.set_parameter("bias_k", make_tensor(DType::Float64, {1, 1, qk},
                                              repeat_row_blocks(to_doubles(grouped.parameter("bias_k")),
                                                                gc.num_kv_heads, g, gc.d_k, 1)));
    plain.set_parameter("bias_v", make_tensor(DType::Float64, {1, 1, gc.num_heads * gc.d_v},
                                              repeat_row_blocks(to_doubles(grouped.parameter("bias_v")),
                                                                gc.num_kv_heads, g, gc.d_v, 1)));
  }
  plain.set_parameter("out_proj.weight", grouped.parameter("out_proj.weight"));
  (void)vk;
  return plain;
}

::testing::AssertionResult close(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  double worst = 0, scale = 1;
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  if (worst <= 1e-12 * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max difference " << worst << " (scale " << scale << ")";
}

class GroupedLayer : public ::testing::TestWithParam<GroupedLayerCase> {};

TEST_P(GroupedLayer, EqualsTheLayerWithRepeatedKeyValueHeads) {
  const GroupedLayerCase& c = GetParam();
  MultiHeadAttention grouped(config_of(c, c.h_kv, DType::Float64), name_seed(c.name));
  const MultiHeadAttentionConfig& gc = grouped.config();
  ASSERT_EQ(gc.num_kv_heads, c.h_kv);
  EXPECT_FALSE(grouped.packed_in_proj());
  EXPECT_EQ(grouped.parameter("k_proj_weight").shape(), (Shape{c.h_kv * gc.d_k, gc.kdim}));
  EXPECT_EQ(grouped.parameter("v_proj_weight").shape(), (Shape{c.h_kv * gc.d_v, gc.vdim}));
  MultiHeadAttention plain = repeated_layer(grouped, c);

  Rng rng(name_seed(c.name) + 1);
  const std::int64_t B = 2, L = 5, S = 7;
  auto shape = [&](std::int64_t T, std::int64_t width) {
    return c.batch_first ? Shape{B, T, width} : Shape{T, B, width};
  };
  const Tensor query = random_tensor(DType::Float64, shape(L, c.E), rng);
  const Tensor key = random_tensor(DType::Float64, shape(S, gc.kdim), rng);
  const Tensor value = random_tensor(DType::Float64, shape(S, gc.vdim), rng);
  const Tensor dout = random_tensor(DType::Float64, shape(L, c.E), rng);
  MultiHeadAttentionInputs in;
  in.causal = c.causal;
  in.average_attn_weights = false;
  const auto got = grouped.forward(query, key, value, in), want = plain.forward(query, key, value, in);
  EXPECT_TRUE(close(to_doubles(got.out), to_doubles(want.out), "out"));
  EXPECT_TRUE(close(to_doubles(got.weights), to_doubles(want.weights), "weights"));

  const auto dg = grouped.backward(dout), dp = plain.backward(dout);
  EXPECT_TRUE(close(to_doubles(dg.query), to_doubles(dp.query), "d query"));
  EXPECT_TRUE(close(to_doubles(dg.key), to_doubles(dp.key), "d key"));
  EXPECT_TRUE(close(to_doubles(dg.value), to_doubles(dp.value), "d value"));
  EXPECT_TRUE(close(to_doubles(dg.parameters.at("out_proj.weight")), to_doubles(dp.parameters.at("out_proj.weight")),
                    "d out_proj.weight"));
  const std::int64_t g = c.h / c.h_kv, qk = c.h * gc.d_k;
  if (plain.packed_in_proj()) {  // rows [q | k | v] of the plain layer's packed gradient
    const std::vector<double> d = to_doubles(dp.parameters.at("in_proj_weight"));
    const auto rows = [&](std::int64_t from, std::int64_t count) {
      return std::vector<double>(d.begin() + from * c.E, d.begin() + (from + count) * c.E);
    };
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("q_proj_weight")), rows(0, qk), "d q_proj_weight"));
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("k_proj_weight")),
                      sum_row_blocks(rows(qk, qk), c.h_kv, g, gc.d_k, gc.kdim), "d k_proj_weight"));
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("v_proj_weight")),
                      sum_row_blocks(rows(2 * qk, c.h * gc.d_v), c.h_kv, g, gc.d_v, gc.vdim), "d v_proj_weight"));
  } else {
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("q_proj_weight")), to_doubles(dp.parameters.at("q_proj_weight")),
                      "d q_proj_weight"));
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("k_proj_weight")),
                      sum_row_blocks(to_doubles(dp.parameters.at("k_proj_weight")), c.h_kv, g, gc.d_k, gc.kdim),
                      "d k_proj_weight"));
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("v_proj_weight")),
                      sum_row_blocks(to_doubles(dp.parameters.at("v_proj_weight")), c.h_kv, g, gc.d_v, gc.vdim),
                      "d v_proj_weight"));
  }
  if (c.bias) {
    const std::vector<double> d = to_doubles(dp.parameters.at("in_proj_bias"));
    std::vector<double> want_bias(d.begin(), d.begin() + qk);
    const std::vector<double> bk = sum_row_blocks({d.begin() + qk, d.begin() + 2 * qk}, c.h_kv, g, gc.d_k, 1);
    const std::vector<double> bv = sum_row_blocks({d.begin() + 2 * qk, d.end()}, c.h_kv, g, gc.d_v, 1);
    want_bias.insert(want_bias.end(), bk.begin(), bk.end());
    want_bias.insert(want_bias.end(), bv.begin(), bv.end());
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("in_proj_bias")), want_bias, "d in_proj_bias"));
  }
  if (c.add_bias_kv) {
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("bias_k")),
                      sum_row_blocks(to_doubles(dp.parameters.at("bias_k")), c.h_kv, g, gc.d_k, 1), "d bias_k"));
    EXPECT_TRUE(close(to_doubles(dg.parameters.at("bias_v")),
                      sum_row_blocks(to_doubles(dp.parameters.at("bias_v")), c.h_kv, g, gc.d_v, 1), "d bias_v"));
  }
}

TEST_P(GroupedLayer, CachedDecodingFloat32AndSaveLoad) {
  const GroupedLayerCase& c = GetParam();
  MultiHeadAttention layer(config_of(c, c.h_kv, DType::Float64), name_seed(c.name) + 2);
  layer.train(false);
  Rng rng(name_seed(c.name) + 3);
  const MultiHeadAttentionConfig& gc = layer.config();
  const std::int64_t B = 2, L = 3, S = 6;
  auto shape = [&](std::int64_t T, std::int64_t width) {
    return c.batch_first ? Shape{B, T, width} : Shape{T, B, width};
  };
  const Tensor query = random_tensor(DType::Float64, shape(L, c.E), rng);
  const Tensor key = random_tensor(DType::Float64, shape(S, gc.kdim), rng);
  const Tensor value = random_tensor(DType::Float64, shape(S, gc.vdim), rng);
  const auto full = layer.forward(query, key, value);
  mha::KeyValueCache cache;
  layer.append_to_cache(cache, key, value);
  EXPECT_TRUE(close(to_doubles(layer.forward_cached(query, cache).out), to_doubles(full.out), "cached out"));

  // float32 (the fused kernel) against float64, on the float64 layer's parameters
  MultiHeadAttention layer32(config_of(c, c.h_kv, DType::Float32), 1);
  layer32.load_state_dict(layer.state_dict());
  layer32.train(false);
  const auto out32 = layer32.forward(Tensor::copy_of(query, DType::Float32), Tensor::copy_of(key, DType::Float32),
                                     Tensor::copy_of(value, DType::Float32));
  const std::vector<double> a = to_doubles(out32.out), b = to_doubles(full.out);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "float32 out " << i;

  const std::string path =
      (std::filesystem::temp_directory_path() / (std::string(c.name) + "_gqa.safetensors")).string();
  mha::save_safetensors(layer, path);
  MultiHeadAttention loaded = mha::load_multi_head_attention(path);
  std::remove(path.c_str());
  EXPECT_EQ(loaded.config().num_kv_heads, c.h_kv);
  loaded.train(false);
  EXPECT_TRUE(close(to_doubles(loaded.forward(query, key, value).out), to_doubles(full.out), "loaded out"));
}

INSTANTIATE_TEST_SUITE_P(Cases, GroupedLayer, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<GroupedLayerCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(GroupedLayerConfig, NumKvHeadsMustDivideNumHeads) {
  for (std::int64_t bad : {-1, 3, 5, 8}) {
    MultiHeadAttentionConfig cfg;
    cfg.d_model = 8, cfg.num_heads = 4, cfg.num_kv_heads = bad;
    try {
      MultiHeadAttention layer(cfg, 1);
      ADD_FAILURE() << "num_kv_heads = " << bad << " accepted";
    } catch (const mha::Error& e) {
      EXPECT_NE(std::string(e.what()).find("num_kv_heads"), std::string::npos) << e.what();
    }
  }
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 8, cfg.num_heads = 4;
  EXPECT_EQ(MultiHeadAttention(cfg, 1).config().num_kv_heads, 4);  // 0: one per head
}

}  // namespace
}  // namespace mha_test
