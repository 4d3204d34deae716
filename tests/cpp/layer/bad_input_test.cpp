// Bad input at every public entry point: each case must throw mha::Error (a std::invalid_argument)
// whose message names the offending argument, as include/mha/error.hpp promises. One named test per
// case. A second, smaller table holds inputs the headers do not clearly rule out: there a throw must
// still be a well-formed mha::Error, and where the call succeeds its result must make sense.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <regex>
#include <string>
#include <type_traits>
#include <vector>

#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;
using mha::scaled_dot_product_attention;

struct BadCase {
  const char* name;
  std::function<void()> call;
  const char* names_arg;  // ECMAScript regex the message must match (the argument's name)
};

// scaled_dot_product_attention's arguments are called q, k, v in the header; accept those names as
// whole words, or the long names.
constexpr const char* kQ = R"(\b(q|query)\b)";
constexpr const char* kK = R"(\b(k|key)\b)";
constexpr const char* kV = R"(\b(v|value)\b)";

// A valid SDPA call: q [2, 3, 4, 5], k [2, 3, 6, 5], v [2, 3, 6, 7], float32, and variants.
constexpr std::int64_t B = 2, H = 3, L = 4, S = 6, DK = 5, DV = 7;
Tensor T(Shape s, DType d = DType::Float32) { return Tensor(d, std::move(s)); }

void sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o = {}) {
  (void)scaled_dot_product_attention(q, k, v, o);
}
void sdpa_with(const std::function<void(AttentionOptions&, std::vector<Tensor>&)>& set) {
  std::vector<Tensor> keep;
  AttentionOptions o;
  set(o, keep);
  (void)scaled_dot_product_attention(T({B, H, L, DK}), T({B, H, S, DK}), T({B, H, S, DV}), o);
}

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
  // ---- scaled_dot_product_attention: shapes and dtypes of q, k, v ----
  c.push_back({"sdpa_q_rank3", [] { sdpa(T({B, L, DK}), T({B, H, S, DK}), T({B, H, S, DV})); }, kQ});
  c.push_back({"sdpa_q_rank5", [] { sdpa(T({1, B, H, L, DK}), T({B, H, S, DK}), T({B, H, S, DV})); }, kQ});
  c.push_back({"sdpa_k_rank3", [] { sdpa(T({B, H, L, DK}), T({B, S, DK}), T({B, H, S, DV})); }, kK});
  c.push_back({"sdpa_v_rank2", [] { sdpa(T({B, H, L, DK}), T({B, H, S, DK}), T({S, DV})); }, kV});
  c.push_back({"sdpa_k_batch_mismatch", [] { sdpa(T({B, H, L, DK}), T({1, H, S, DK}), T({B, H, S, DV})); }, kK});
  c.push_back({"sdpa_k_heads_mismatch", [] { sdpa(T({B, H, L, DK}), T({B, 2, S, DK}), T({B, H, S, DV})); }, kK});
  c.push_back({"sdpa_k_width_mismatch", [] { sdpa(T({B, H, L, DK}), T({B, H, S, DK + 1}), T({B, H, S, DV})); }, kK});
  c.push_back({"sdpa_v_batch_mismatch", [] { sdpa(T({B, H, L, DK}), T({B, H, S, DK}), T({B + 1, H, S, DV})); }, kV});
  c.push_back({"sdpa_v_heads_mismatch", [] { sdpa(T({B, H, L, DK}), T({B, H, S, DK}), T({B, H + 1, S, DV})); }, kV});
  c.push_back({"sdpa_v_seq_mismatch", [] { sdpa(T({B, H, L, DK}), T({B, H, S, DK}), T({B, H, S - 1, DV})); }, kV});
  c.push_back({"sdpa_k_float64_with_q_float32", [] {
                 sdpa(T({B, H, L, DK}), T({B, H, S, DK}, DType::Float64), T({B, H, S, DV}));
               }, kK});
  c.push_back({"sdpa_v_float64_with_q_float32", [] {
                 sdpa(T({B, H, L, DK}), T({B, H, S, DK}), T({B, H, S, DV}, DType::Float64));
               }, kV});
  c.push_back({"sdpa_all_bool", [] {
                 sdpa(T({B, H, L, DK}, DType::Bool), T({B, H, S, DK}, DType::Bool), T({B, H, S, DV}, DType::Bool));
               }, kQ});
  c.push_back({"sdpa_q_negative_stride", [] {
                 Tensor q = T({B, H, L, DK});
                 const auto* last = q.data_as<float>() + (q.numel() - 1);
                 TensorView qv(last, DType::Float32, {B, H, L, DK}, {-H * L * DK, -L * DK, -DK, -1});
                 (void)scaled_dot_product_attention(qv, T({B, H, S, DK}), T({B, H, S, DV}));
               }, "stride"});
  c.push_back({"view_strides_rank_mismatch", [] {
                 Tensor q = T({B, H, L, DK});
                 TensorView qv(q.data(), DType::Float32, {B, H, L, DK}, {H * L * DK, L * DK, DK});
                 (void)scaled_dot_product_attention(qv, T({B, H, S, DK}), T({B, H, S, DV}));
               }, "stride"});
  // ---- masks ----
  c.push_back({"sdpa_key_padding_mask_wrong_S", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, S + 1}, DType::Bool));
                   o.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"sdpa_key_padding_mask_wrong_B", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B + 1, S}, DType::Bool));
                   o.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"sdpa_key_padding_mask_rank3", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, 1, S}, DType::Bool));
                   o.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"sdpa_key_padding_mask_float", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, S}, DType::Float32));
                   o.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"sdpa_key_lengths_too_few", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.key_lengths = {S}; });
               }, "key_lengths"});
  c.push_back({"sdpa_key_lengths_too_many", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.key_lengths = {1, 2, 3}; });
               }, "key_lengths"});
  c.push_back({"sdpa_key_lengths_negative", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.key_lengths = {2, -1}; });
               }, "key_lengths"});
  c.push_back({"sdpa_key_lengths_above_S", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.key_lengths = {S + 1, 2}; });
               }, "key_lengths"});
  c.push_back({"sdpa_attn_mask_wrong_L", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({L + 1, S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  c.push_back({"sdpa_attn_mask_wrong_S", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({L, S - 1}, DType::Float32));
                   o.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  c.push_back({"sdpa_attn_mask_3d_first_dim_B_not_Bh", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, L, S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  c.push_back({"sdpa_attn_mask_rank1", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  c.push_back({"sdpa_attn_mask_rank4", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, H, L, S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  // ---- dropout ----
  c.push_back({"sdpa_dropout_p_one", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.dropout_p = 1.0; });
               }, "dropout"});
  c.push_back({"sdpa_dropout_p_negative", [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.dropout_p = -0.1; });
               }, "dropout"});
  c.push_back({"sdpa_dropout_p_nan", [nan] {
                 sdpa_with([nan](AttentionOptions& o, std::vector<Tensor>&) { o.dropout_p = nan; });
               }, "dropout"});
  // ---- MultiHeadAttention config ----
  c.push_back({"mha_num_heads_zero", [] { construct([](auto& c) { c.num_heads = 0; }); }, "num_heads"});
  c.push_back({"mha_num_heads_negative", [] { construct([](auto& c) { c.num_heads = -2; }); }, "num_heads"});
  c.push_back({"mha_d_model_zero", [] { construct([](auto& c) { c.d_model = 0; }); }, "d_model"});
  c.push_back({"mha_d_model_negative", [] { construct([](auto& c) { c.d_model = -8; }); }, "d_model"});
  c.push_back({"mha_d_model_not_divisible_default_d_k", [] {
                 construct([](auto& c) { c.d_model = 10, c.num_heads = 3; });
               }, "d_model|num_heads|d_k"});
  c.push_back({"mha_d_model_not_divisible_default_d_v_only", [] {
                 construct([](auto& c) { c.d_model = 10, c.num_heads = 3, c.d_k = 4; });
               }, "d_model|num_heads|d_v"});
  c.push_back({"mha_d_k_negative", [] { construct([](auto& c) { c.d_k = -4; }); }, "d_k"});
  c.push_back({"mha_d_v_negative", [] { construct([](auto& c) { c.d_v = -1; }); }, "d_v"});
  c.push_back({"mha_kdim_negative", [] { construct([](auto& c) { c.kdim = -3; }); }, "kdim"});
  c.push_back({"mha_vdim_negative", [] { construct([](auto& c) { c.vdim = -3; }); }, "vdim"});
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
  c.push_back({"mha_query_float64_in_float32_module", [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}, DType::Float64), T({2, 4, 8}), T({2, 4, 8}));
               }, "query"});
  c.push_back({"mha_key_float64_in_float32_module", [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}, DType::Float64), T({2, 4, 8}));
               }, "key"});
  c.push_back({"mha_all_float32_in_float64_module", [] {
                 MultiHeadAttentionConfig cfg = cfg8();
                 cfg.dtype = DType::Float64;
                 MultiHeadAttention m(cfg);
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
               }, "query"});
  c.push_back({"mha_query_bool", [] { forward({2, 3, 8}, {2, 4, 8}, {2, 4, 8}, DType::Bool); }, "query"});
  c.push_back({"mha_key_padding_mask_wrong_S", [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2, 5}, DType::Bool));
                   in.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"mha_key_padding_mask_float", [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2, 4}, DType::Float32));
                   in.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"mha_unbatched_key_padding_mask_2d", [] {
                 forward({3, 8}, {4, 8}, {4, 8}, DType::Float32, [](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2, 4}, DType::Bool));
                   in.key_padding_mask = k.back().view();
                 });
               }, "key_padding_mask"});
  c.push_back({"mha_key_lengths_count", [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>&) { in.key_lengths = {4}; });
               }, "key_lengths"});
  c.push_back({"mha_key_lengths_above_S", [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>&) { in.key_lengths = {4, 5}; });
               }, "key_lengths"});
  c.push_back({"mha_attn_mask_wrong_S", [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({3, 5}, DType::Bool));
                   in.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  c.push_back({"mha_attn_mask_3d_wrong_first_dim", [] {
                 forward_with([](MultiHeadAttentionInputs& in, std::vector<Tensor>& k) {
                   k.push_back(T({2 * 2 + 1, 3, 4}, DType::Bool));
                   in.attn_mask = k.back().view();
                 });
               }, "attn_mask"});
  // ---- parameters ----
  c.push_back({"mha_parameter_unknown", [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.parameter("no_such_param");
               }, "no_such_param"});
  c.push_back({"mha_set_parameter_unknown", [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("weight_typo", T({8, 8}));
               }, "weight_typo"});
  c.push_back({"mha_set_parameter_separate_name_on_packed", [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("q_proj_weight", T({8, 8}));
               }, "q_proj_weight"});
  c.push_back({"mha_set_parameter_bias_when_bias_false", [] {
                 MultiHeadAttentionConfig cfg = cfg8();
                 cfg.bias = false;
                 MultiHeadAttention m(cfg);
                 m.set_parameter("in_proj_bias", T({24}));
               }, "in_proj_bias"});
  c.push_back({"mha_set_parameter_wrong_shape", [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("in_proj_weight", T({24, 7}));
               }, "in_proj_weight"});
  c.push_back({"mha_set_parameter_wrong_rank", [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("out_proj.bias", T({1, 8}));
               }, "out_proj\\.bias"});
  c.push_back({"mha_set_parameter_bool", [] {
                 MultiHeadAttention m(cfg8());
                 m.set_parameter("out_proj.weight", T({8, 8}, DType::Bool));
               }, "out_proj\\.weight"});
  c.push_back({"mha_load_state_dict_missing", [] {
                 MultiHeadAttention m(cfg8());
                 auto s = full_state(m);
                 s.erase("in_proj_bias");
                 m.load_state_dict(views(s));
               }, "in_proj_bias"});
  c.push_back({"mha_load_state_dict_unknown", [] {
                 MultiHeadAttention m(cfg8());
                 auto s = full_state(m);
                 s.emplace("extra.weight", T({2}));
                 m.load_state_dict(views(s));
               }, "extra\\.weight"});
  c.push_back({"mha_load_state_dict_misshaped", [] {
                 MultiHeadAttention m(cfg8());
                 auto s = full_state(m);
                 s.erase("out_proj.weight");
                 s.emplace("out_proj.weight", T({8, 9}));
                 m.load_state_dict(views(s));
               }, "out_proj\\.weight"});
  // ---- backward ----
  c.push_back({"mha_backward_without_forward", [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.backward(T({2, 3, 8}));
               }, "forward"});
  c.push_back({"mha_backward_after_eval_forward", [] {
                 MultiHeadAttention m(cfg8());
                 m.eval();
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
                 (void)m.backward(T({2, 3, 8}));
               }, "forward|train"});
  c.push_back({"mha_backward_dout_wrong_shape", [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
                 (void)m.backward(T({2, 4, 8}));
               }, "dout"});
  c.push_back({"mha_backward_dout_wrong_dtype", [] {
                 MultiHeadAttention m(cfg8());
                 (void)m.forward(T({2, 3, 8}), T({2, 4, 8}), T({2, 4, 8}));
                 (void)m.backward(T({2, 3, 8}, DType::Float64));
               }, "dout"});
  c.push_back({"sdpa_backward_dout_wrong_shape", [] {
                 Tensor q = T({B, H, L, DK}), k = T({B, H, S, DK}), v = T({B, H, S, DV});
                 AttentionOptions o;
                 o.need_lse = true;
                 const auto f = scaled_dot_product_attention(q, k, v, o);
                 (void)mha::scaled_dot_product_attention_backward(T({B, H, L, DV + 1}), q, k, v, f.out, f.lse, o);
               }, "dout"});
  c.push_back({"sdpa_backward_lse_wrong_shape", [] {
                 Tensor q = T({B, H, L, DK}), k = T({B, H, S, DK}), v = T({B, H, S, DV});
                 AttentionOptions o;
                 o.need_lse = true;
                 const auto f = scaled_dot_product_attention(q, k, v, o);
                 (void)mha::scaled_dot_product_attention_backward(T({B, H, L, DV}), q, k, v, f.out, T({B, H, L + 1}), o);
               }, "lse"});
  c.push_back({"sdpa_backward_out_wrong_shape", [] {
                 Tensor q = T({B, H, L, DK}), k = T({B, H, S, DK}), v = T({B, H, S, DV});
                 AttentionOptions o;
                 o.need_lse = true;
                 const auto f = scaled_dot_product_attention(q, k, v, o);
                 (void)mha::scaled_dot_product_attention_backward(T({B, H, L, DV}), q, k, v, T({B, H, L, DK}), f.lse, o);
               }, R"(\b(out|o)\b)"});
  // ---- Tensor ----
  c.push_back({"tensor_reshaped_wrong_count", [] { (void)T({2, 3}).reshaped({4}); }, "shape"});
  c.push_back({"tensor_negative_dim", [] { (void)T({2, -1}); }, "shape|dim|-1"});
  return c;
}

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInput, ThrowsErrorNamingTheArgument) {
  const BadCase& c = GetParam();
  bool threw = false;
  try {
    c.call();
  } catch (const std::invalid_argument& e) {
    threw = true;
    EXPECT_NE(dynamic_cast<const mha::Error*>(&e), nullptr)
        << "a std::invalid_argument that is not mha::Error: " << e.what();
    EXPECT_TRUE(std::regex_search(e.what(), std::regex(c.names_arg)))
        << "message does not name the argument (/" << c.names_arg << "/): " << e.what();
  } catch (const std::exception& e) {
    threw = true;
    ADD_FAILURE() << "threw a std::exception that is not mha::Error: " << e.what();
  } catch (...) {
    threw = true;
    ADD_FAILURE() << "threw something that is not a std::exception";
  }
  EXPECT_TRUE(threw) << "no exception";
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInput, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

static_assert(std::is_base_of_v<std::invalid_argument, mha::Error>);

// ---- inputs the headers do not clearly rule in or out -------------------------------------------
// If the call throws, it must be an mha::Error naming the argument; if it succeeds, the result is
// checked where the header implies one. Either way the behaviour is printed for the report.

void expect_error_if_thrown(const std::function<void()>& call, const char* names_arg, const char* what) {
  try {
    call();
    std::cout << "[ note ] " << what << ": accepted\n";
  } catch (const std::invalid_argument& e) {
    std::cout << "[ note ] " << what << ": rejected: " << e.what() << "\n";
    EXPECT_NE(dynamic_cast<const mha::Error*>(&e), nullptr) << e.what();
    EXPECT_TRUE(std::regex_search(e.what(), std::regex(names_arg))) << e.what();
  }
}

TEST(Underspecified, KeyPaddingMaskTogetherWithKeyLengths) {
  // "key_lengths: alternative to key_padding_mask". Either rejected, or both apply.
  Rng rng(51);
  Tensor q = random_tensor(DType::Float64, {B, H, L, DK}, rng);
  Tensor k = random_tensor(DType::Float64, {B, H, S, DK}, rng);
  Tensor v = random_tensor(DType::Float64, {B, H, S, DV}, rng);
  NaiveMaskSpec m;
  m.B = B, m.h = H, m.L = L, m.S = S;
  m.key_padding = {1, 0, 0, 0, 0, 0, /* b=1 */ 0, 0, 1, 0, 0, 0};
  m.key_lengths = {4, 5};
  std::vector<Tensor> keep;
  AttentionOptions o = options_for(m, DType::Float64, keep);
  expect_error_if_thrown(
      [&] {
        const auto r = scaled_dot_product_attention(q, k, v, o);
        const NaiveResult want = naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), DK, DV,
                                                 1.0 / std::sqrt(static_cast<double>(DK)), m);
        EXPECT_TRUE(all_close(to_doubles(r.out), want.out, 1e-12, 1e-12)) << "accepted, so both masks must apply";
      },
      "key_padding_mask|key_lengths", "key_padding_mask and key_lengths together");
}

TEST(Underspecified, ScaleNotFiniteOrNotPositive) {
  Rng rng(52);
  Tensor q = random_tensor(DType::Float64, {1, 1, 3, 2}, rng);
  Tensor k = random_tensor(DType::Float64, {1, 1, 4, 2}, rng);
  Tensor v = random_tensor(DType::Float64, {1, 1, 4, 2}, rng);
  NaiveMaskSpec m;
  m.B = 1, m.h = 1, m.L = 3, m.S = 4;
  for (double scale : {0.0, -0.5}) {
    // Mathematically well defined: if accepted, must match the oracle.
    AttentionOptions o;
    o.scale = scale;
    expect_error_if_thrown(
        [&] {
          const auto r = scaled_dot_product_attention(q, k, v, o);
          const NaiveResult want = naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), 2, 2, scale, m);
          EXPECT_TRUE(all_close(to_doubles(r.out), want.out, 1e-12, 1e-12));
        },
        "scale", (std::string("scale = ") + std::to_string(scale)).c_str());
  }
  for (double scale : {std::numeric_limits<double>::quiet_NaN(), kInf}) {
    AttentionOptions o;
    o.scale = scale;
    expect_error_if_thrown([&] { (void)scaled_dot_product_attention(q, k, v, o); }, "scale",
                           (std::string("scale = ") + std::to_string(scale)).c_str());
  }
}

TEST(Underspecified, FloatAttnMaskOfTheOtherFloatDtype) {
  // A float64 additive mask with float32 q, k, v: the header says "bool or float".
  Rng rng(53);
  Tensor q = random_tensor(DType::Float32, {1, 2, 3, 4}, rng);
  Tensor k = random_tensor(DType::Float32, {1, 2, 5, 4}, rng);
  Tensor v = random_tensor(DType::Float32, {1, 2, 5, 4}, rng);
  NaiveMaskSpec m;
  m.B = 1, m.h = 2, m.L = 3, m.S = 5;
  m.float_mask = rounded_to(DType::Float32, random_values(15, rng));
  std::vector<Tensor> keep;
  AttentionOptions o = options_for(m, DType::Float64, keep);
  expect_error_if_thrown(
      [&] {
        const auto r = scaled_dot_product_attention(q, k, v, o);
        const NaiveResult want =
            naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), 4, 4, 0.5, m);
        EXPECT_TRUE(all_close(to_doubles(r.out), want.out, 1e-5, 1e-5));
      },
      "attn_mask", "float64 attn_mask with float32 q");
}

TEST(Underspecified, ZeroBatchZeroWidth) {
  Rng rng(54);
  expect_error_if_thrown(
      [&] {
        const auto r = scaled_dot_product_attention(T({0, 2, 3, 4}), T({0, 2, 5, 4}), T({0, 2, 5, 6}));
        EXPECT_EQ(r.out.shape(), (Shape{0, 2, 3, 6}));
      },
      R"(\b(q|query|k|key|v|value)\b)", "B = 0");
  expect_error_if_thrown(
      [&] {
        const auto r = scaled_dot_product_attention(random_tensor(DType::Float32, {1, 1, 3, 4}, rng),
                                                    random_tensor(DType::Float32, {1, 1, 5, 4}, rng), T({1, 1, 5, 0}));
        EXPECT_EQ(r.out.shape(), (Shape{1, 1, 3, 0}));
      },
      R"(\b(v|value)\b|d_v)", "d_v = 0");
  expect_error_if_thrown([&] { (void)scaled_dot_product_attention(T({1, 1, 3, 0}), T({1, 1, 5, 0}), T({1, 1, 5, 2})); },
                         R"(\b(q|query|k|key)\b|d_k)", "d_k = 0 (default scale 1/sqrt(0))");
}

TEST(Underspecified, SetNumThreadsZeroOrNegative) {
  ThreadCountGuard guard;
  for (int n : {0, -1}) {
    expect_error_if_thrown([&] { mha::set_num_threads(n); }, "thread",
                           (std::string("set_num_threads(") + std::to_string(n) + ")").c_str());
    EXPECT_GE(mha::num_threads(), 1) << "num_threads() after set_num_threads(" << n << ")";
  }
}

TEST(Underspecified, CopyOfBetweenBoolAndFloat) {
  Tensor b = make_tensor(DType::Bool, {3}, {1, 0, 1});
  expect_error_if_thrown(
      [&] {
        Tensor f = Tensor::copy_of(b, DType::Float32);
        EXPECT_EQ(to_doubles(f), (std::vector<double>{1, 0, 1}));
      },
      "dtype|bool|float", "copy_of bool -> float32");
  Tensor f = make_tensor(DType::Float32, {3}, {0.0, 2.5, -1.0});
  expect_error_if_thrown(
      [&] {
        Tensor bb = Tensor::copy_of(f, DType::Bool);
        EXPECT_EQ(to_doubles(bb), (std::vector<double>{0, 1, 1}));
      },
      "dtype|bool|float", "copy_of float32 -> bool");
}

}  // namespace
}  // namespace mha_test
