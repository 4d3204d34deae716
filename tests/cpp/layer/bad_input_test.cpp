// Bad input to MultiHeadAttention (support/bad_input.hpp says what each case must do): configs out of
// range; query, key, value and masks of the wrong rank, shape or dtype; unknown, misshaped or missing
// parameters; backward without a training forward or with a bad dout. The same for
// scaled_dot_product_attention is in attention/bad_input_test.cpp, for Tensor in tensor/bad_input_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "support/bad_input.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;

Tensor T(Shape s, DType d = DType::Float32) { return Tensor(d, std::move(s)); }

// A small valid module: E = 8, h = 2, float32, batch first; inputs B = 2, L = 3, S = 4.
MultiHeadAttentionConfig cfg8() {
  MultiHeadAttentionConfig c;
  c.d_model = 8;
  c.num_heads = 2;
  return c;
}
void construct(const std::function<void(MultiHeadAttentionConfig&)>& set) {
  MultiHeadAttentionConfig c = cfg8();
  set(c);
  MultiHeadAttention m(c);
}
void forward(Shape q, Shape k, Shape v, DType dt = DType::Float32,
             const std::function<void(MultiHeadAttentionInputs&, std::vector<Tensor>&)>& set = {}) {
  MultiHeadAttention m(cfg8());
  std::vector<Tensor> keep;
  MultiHeadAttentionInputs in;
  if (set) set(in, keep);
  Tensor tq = T(std::move(q), dt), tk = T(std::move(k), dt), tv = T(std::move(v), dt);
  (void)m.forward(tq, tk, tv, in);
}
void forward_with(const std::function<void(MultiHeadAttentionInputs&, std::vector<Tensor>&)>& set) {
  forward({2, 3, 8}, {2, 4, 8}, {2, 4, 8}, DType::Float32, set);
}
std::map<std::string, Tensor> full_state(const MultiHeadAttention& m) {
  std::map<std::string, Tensor> s;
  for (const auto& n : m.parameter_names()) s.emplace(n, m.parameter(n).clone());
  return s;
}
std::map<std::string, TensorView> views(const std::map<std::string, Tensor>& s) {
  std::map<std::string, TensorView> v;
  for (const auto& [n, t] : s) v.emplace(n, t.view());
  return v;
}

std::vector<BadCase> bad_cases() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<BadCase> c;
  // ---- MultiHeadAttention config ----
  c.push_back({"mha_num_heads_zero", [] { construct([](auto& c) { c.num_heads = 0; }); }, "num_heads"});
  c.push_back({"mha_num_heads_negative", [] { construct([](auto& c) { c.num_heads = -2; }); }, "num_heads"});
  c.push_back({"mha_d_model_zero", [] { construct([](auto& c) { c.d_model = 0; }); }, "d_model"});
  c.push_back({"mha_d_model_negative", [] { construct([](auto& c) { c.d_model = -8; }); }, "d_model"});
  c.push_back({"mha_d_model_not_divisible_default_d_k",
               [] { construct([](auto& c) { c.d_model = 10, c.num_heads = 3; }); }, "d_model|num_heads|d_k"});
  c.push_back({"mha_d_model_not_divisible_default_d_v_only",
               [] { construct([](auto& c) { c.d_model = 10, c.num_heads = 3, c.d_k = 4; }); },
               "d_model|num_heads|d_v"});
  c.push_back({"mha_d_k_negative", [] { construct([](auto& c) { c.d_k = -4; }); }, "d_k"});
  c.push_back({"mha_d_v_negative", [] { construct([](auto& c) { c.d_v = -1; }); }, "d_v"});
  c.push_back({"mha_kdim_negative", [] { construct([](auto& c) { c.kdim = -3; }); }, "kdim"});
  c.push_back({"mha_vdim_negative", [] { construct([](auto& c) { c.vdim = -3; }); }, "vdim"});
  // Sizes whose products overflow (num_heads * d_k, the parameters' element counts): refused naming
  // the config, never built with wrapped (zero or negative) shapes.
  constexpr std::int64_t k2_31 = std::int64_t{1} << 31, k2_32 = std::int64_t{1} << 32, k2_62 = std::int64_t{1} << 62;
  c.push_back({"mha_num_heads_times_d_k_overflows",
               [] { construct([](auto& c) { c.d_model = c.num_heads = c.d_k = c.d_v = k2_32; }); },
               "num_heads \\* d_k"});
  c.push_back({"mha_d_model_2_62", [] { construct([](auto& c) { c.d_model = k2_62, c.num_heads = 1; }); }, "d_model"});
  c.push_back({"mha_kdim_2_62", [] { construct([](auto& c) { c.kdim = k2_62; }); }, "kdim"});
  c.push_back({"mha_in_proj_elements_overflow", [] { construct([](auto& c) { c.d_model = k2_31, c.num_heads = 1; }); },
               "d_model"});
  c.push_back({"mha_k_proj_elements_overflow", [] { construct([](auto& c) { c.kdim = std::int64_t{1} << 58; }); },
               "num_heads \\* d_k \\* kdim"});
  c.push_back({"mha_v_proj_elements_overflow", [] { construct([](auto& c) { c.vdim = std::int64_t{1} << 58; }); },
               "num_heads \\* d_v \\* vdim"});
  c.push_back({"mha_dropout_one", [] { construct([](auto& c) { c.dropout = 1.0; }); }, "dropout"});
  c.push_back({"mha_dropout_negative", [] { construct([](auto& c) { c.dropout = -0.5; }); }, "dropout"});
  c.push_back({"mha_dropout_nan", [nan] { construct([nan](auto& c) { c.dropout = nan; }); }, "dropout"});
  c.push_back({"mha_dtype_bool", [] { construct([](auto& c) { c.dtype = DType::Bool; }); }, "dtype"});
  // ---- MultiHeadAttention::forward ----
  c.push_back({"mha_query_rank4", [] { forward({1, 2, 3, 8}, {2, 4, 8}, {2, 4, 8}); }, "query"});
  c.push_back({"mha_query_rank1", [] { forward({8}, {4, 8}, {4, 8}); }, "query"});
  c.push_back({"mha_query_width_not_E", [] { forward({2, 3, 7}, {2, 4, 8}, {2, 4, 8}); }, "query"});
  c.push_back({"mha_key_rank2_with_batched_query", [] { forward({2, 3, 8}, {4, 8}, {2, 4, 8}); }, "key"});
  c.push_back({"mha_key_batch_mismatch", [] { forward({2, 3, 8}, {3, 4, 8}, {3, 4, 8}); }, "key"});
  c.push_back({"mha_key_width_not_kdim", [] { forward({2, 3, 8}, {2, 4, 6}, {2, 4, 8}); }, "key"});
  c.push_back({"mha_value_width_not_vdim", [] { forward({2, 3, 8}, {2, 4, 8}, {2, 4, 5}); }, "value"});
  c.push_back({"mha_value_seq_mismatch", [] { forward({2, 3, 8}, {2, 4, 8}, {2, 5, 8}); }, "value"});
  c.push_back({"mha_value_batch_mismatch", [] { forward({2, 3, 8}, {2, 4, 8}, {1, 4, 8}); }, "value"});
  c.push_back({"mha_query_float64_in_float32_module",
               [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}, DType::Float64), T({2, 4, 8}), T({2, 4, 8}));
               },
               "query"});
  c.push_back({"mha_key_float64_in_float32_module",
               [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}, DType::Float64), T({2, 4, 8}));
               },
               "key"});
  c.push_back({"mha_all_float32_in_float64_module",
               [] {
                 MultiHeadAttentionConfig cfg = cfg8();
                 cfg.dtype = DType::Float64;
                 MultiHeadAttention m(cfg);
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
               },
               "query"});
  c.push_back({"mha_query_bool", [] { forward({2, 3, 8}, {2, 4, 8}, {2, 4, 8}, DType::Bool); }, "query"});
  c.push_back({"mha_key_padding_mask_wrong_S",
               [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2, 5}, DType::Bool));
                   in.key_padding_mask = k.back().view();
                 });
               },
               "key_padding_mask"});
  c.push_back({"mha_key_padding_mask_float_shape",
               [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2, 5}, DType::Float32));
                   in.key_padding_mask = k.back().view();
                 });
               },
               "key_padding_mask"});
  c.push_back({"mha_unbatched_key_padding_mask_2d",
               [] {
                 forward({3, 8}, {4, 8}, {4, 8}, DType::Float32,
                         [](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                           k.push_back(T({2, 4}, DType::Bool));
                           in.key_padding_mask = k.back().view();
                         });
               },
               "key_padding_mask"});
  c.push_back({"mha_key_lengths_count",
               [] { forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>&) { in.key_lengths = {4}; }); },
               "key_lengths"});
  c.push_back({"mha_key_lengths_above_S",
               [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>&) { in.key_lengths = {4, 5}; });
               },
               "key_lengths"});
  c.push_back({"mha_attn_mask_wrong_S",
               [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({3, 5}, DType::Bool));
                   in.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  c.push_back({"mha_attn_mask_3d_wrong_first_dim",
               [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2 * 2 + 1, 3, 4}, DType::Bool));
                   in.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  // ---- parameters ----
  c.push_back({"mha_parameter_unknown",
               [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.parameter("no_such_param");
               },
               "no_such_param"});
  c.push_back({"mha_set_parameter_unknown",
               [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("weight_typo", T({8, 8}));
               },
               "weight_typo"});
  c.push_back({"mha_set_parameter_separate_name_on_packed",
               [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("q_proj_weight", T({8, 8}));
               },
               "q_proj_weight"});
  c.push_back({"mha_set_parameter_bias_when_bias_false",
               [] {
                 MultiHeadAttentionConfig cfg = cfg8();
                 cfg.bias = false;
                 MultiHeadAttention m(cfg);
                 m.set_parameter("in_proj_bias", T({24}));
               },
               "in_proj_bias"});
  c.push_back({"mha_set_parameter_wrong_shape",
               [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("in_proj_weight", T({24, 7}));
               },
               "in_proj_weight"});
  c.push_back({"mha_set_parameter_wrong_rank",
               [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("out_proj.bias", T({1, 8}));
               },
               "out_proj\\.bias"});
  c.push_back({"mha_set_parameter_bool",
               [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("out_proj.weight", T({8, 8}, DType::Bool));
               },
               "out_proj\\.weight"});
  c.push_back({"mha_load_state_dict_missing",
               [] {
                 MultiHeadAttention m(cfg8());
                 auto s = full_state(m);
                 s.erase("in_proj_bias");
                 m.load_state_dict(views(s));
               },
               "in_proj_bias"});
  c.push_back({"mha_load_state_dict_unknown",
               [] {
                 MultiHeadAttention m(cfg8());
                 auto s = full_state(m);
                 s.emplace("extra.weight", T({2}));
                 m.load_state_dict(views(s));
               },
               "extra\\.weight"});
  c.push_back({"mha_load_state_dict_misshaped",
               [] {
                 MultiHeadAttention m(cfg8());
                 auto s = full_state(m);
                 s.erase("out_proj.weight");
                 s.emplace("out_proj.weight", T({8, 9}));
                 m.load_state_dict(views(s));
               },
               "out_proj\\.weight"});
  // ---- backward ----
  c.push_back({"mha_backward_without_forward",
               [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.backward(T({2, 3, 8}));
               },
               "forward"});
  c.push_back({"mha_backward_after_eval_forward",
               [] {
                 MultiHeadAttention m(cfg8());
                 m.eval();
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
                 (void)m.backward(T({2, 3, 8}));
               },
               "forward|train"});
  c.push_back({"mha_backward_dout_wrong_shape",
               [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
                 (void)m.backward(T({2, 4, 8}));
               },
               "dout"});
  c.push_back({"mha_backward_dout_wrong_dtype",
               [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
                 (void)m.backward(T({2, 3, 8}, DType::Float64));
               },
               "dout"});
  return c;
}

class LayerBadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(LayerBadInput, ThrowsErrorNamingTheArgument) { expect_error_naming_the_argument(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, LayerBadInput, ::testing::ValuesIn(bad_cases()), bad_case_name);

}  // namespace
}  // namespace mha_test
