// Bad input to scaled_dot_product_attention, its backward and set_num_threads (support/bad_input.hpp
// says what each case must do): q, k, v of the wrong rank, shape, dtype or strides; masks, key_lengths
// and dropout_p out of range; dout, out and lse of the wrong shape. Then the inputs the headers do not
// clearly rule out. MultiHeadAttention's bad input is in layer/bad_input_test.cpp, Tensor's in
// tensor/bad_input_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "support/bad_input.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;
using mha::scaled_dot_product_attention;

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
  c.push_back({"sdpa_k_float64_with_q_float32",
               [] {
                 sdpa(T({B, H, L, DK}), T({B, H, S, DK}, DType::Float64), T({B, H, S, DV}));
               },
               kK});
  c.push_back({"sdpa_v_float64_with_q_float32",
               [] {
                 sdpa(T({B, H, L, DK}), T({B, H, S, DK}), T({B, H, S, DV}, DType::Float64));
               },
               kV});
  c.push_back({"sdpa_all_bool",
               [] {
                 sdpa(T({B, H, L, DK}, DType::Bool), T({B, H, S, DK}, DType::Bool), T({B, H, S, DV}, DType::Bool));
               },
               kQ});
  c.push_back({"sdpa_q_negative_stride",
               [] {
                 Tensor q = T({B, H, L, DK});
                 const auto* last = q.data_as<float>() + (q.numel() - 1);
                 TensorView qv(last, DType::Float32, {B, H, L, DK}, {-H * L * DK, -L * DK, -DK, -1});
                 (void)scaled_dot_product_attention(qv, T({B, H, S, DK}), T({B, H, S, DV}));
               },
               "stride"});
  c.push_back({"view_strides_rank_mismatch",
               [] {
                 Tensor q = T({B, H, L, DK});
                 TensorView qv(q.data(), DType::Float32, {B, H, L, DK}, {H * L * DK, L * DK, DK});
                 (void)scaled_dot_product_attention(qv, T({B, H, S, DK}), T({B, H, S, DV}));
               },
               "stride"});
  // ---- masks ----
  c.push_back({"sdpa_key_padding_mask_wrong_S",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, S + 1}, DType::Bool));
                   o.key_padding_mask = k.back().view();
                 });
               },
               "key_padding_mask"});
  c.push_back({"sdpa_key_padding_mask_wrong_B",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B + 1, S}, DType::Bool));
                   o.key_padding_mask = k.back().view();
                 });
               },
               "key_padding_mask"});
  c.push_back({"sdpa_key_padding_mask_rank3",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, 1, S}, DType::Bool));
                   o.key_padding_mask = k.back().view();
                 });
               },
               "key_padding_mask"});
  c.push_back({"sdpa_key_padding_mask_other_float",  // a float one must have q's dtype (added to the logits)
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, S}, DType::Float64));
                   o.key_padding_mask = k.back().view();
                 });
               },
               "key_padding_mask"});
  c.push_back({"sdpa_key_lengths_too_few",
               [] { sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.key_lengths = {S}; }); },
               "key_lengths"});
  c.push_back({"sdpa_key_lengths_too_many",
               [] { sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) {
                      o.key_lengths = {1, 2, 3};
                    }); },
               "key_lengths"});
  c.push_back({"sdpa_key_lengths_negative",
               [] { sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) {
                      o.key_lengths = {2, -1};
                    }); },
               "key_lengths"});
  c.push_back({"sdpa_key_lengths_above_S",
               [] { sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) {
                      o.key_lengths = {S + 1, 2};
                    }); },
               "key_lengths"});
  c.push_back({"sdpa_attn_mask_wrong_L",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({L + 1, S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  c.push_back({"sdpa_attn_mask_wrong_S",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({L, S - 1}, DType::Float32));
                   o.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  c.push_back({"sdpa_attn_mask_3d_first_dim_B_not_Bh",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, L, S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  c.push_back({"sdpa_attn_mask_rank1",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  c.push_back({"sdpa_attn_mask_rank4",
               [] {
                 sdpa_with([](AttentionOptions& o, std::vector<Tensor>& k) {
                   k.push_back(T({B, H, L, S}, DType::Bool));
                   o.attn_mask = k.back().view();
                 });
               },
               "attn_mask"});
  // ---- dropout ----
  c.push_back({"sdpa_dropout_p_one",
               [] { sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.dropout_p = 1.0; }); }, "dropout"});
  c.push_back({"sdpa_dropout_p_negative",
               [] { sdpa_with([](AttentionOptions& o, std::vector<Tensor>&) { o.dropout_p = -0.1; }); }, "dropout"});
  c.push_back({"sdpa_dropout_p_nan",
               [nan] { sdpa_with([nan](AttentionOptions& o, std::vector<Tensor>&) { o.dropout_p = nan; }); },
               "dropout"});
  // ---- backward ----
  c.push_back({"sdpa_backward_dout_wrong_shape",
               [] {
                 Tensor q = T({B, H, L, DK}), k = T({B, H, S, DK}), v = T({B, H, S, DV});
                 AttentionOptions o;
                 o.need_lse = true;
                 const auto f = scaled_dot_product_attention(q, k, v, o);
                 (void)mha::scaled_dot_product_attention_backward(T({B, H, L, DV + 1}), q, k, v, f.out, f.lse, o);
               },
               "dout"});
  c.push_back(
      {"sdpa_backward_lse_wrong_shape",
       [] {
         Tensor q = T({B, H, L, DK}), k = T({B, H, S, DK}), v = T({B, H, S, DV});
         AttentionOptions o;
         o.need_lse = true;
         const auto f = scaled_dot_product_attention(q, k, v, o);
         (void)mha::scaled_dot_product_attention_backward(T({B, H, L, DV}), q, k, v, f.out, T({B, H, L + 1}), o);
       },
       "lse"});
  c.push_back(
      {"sdpa_backward_out_wrong_shape",
       [] {
         Tensor q = T({B, H, L, DK}), k = T({B, H, S, DK}), v = T({B, H, S, DV});
         AttentionOptions o;
         o.need_lse = true;
         const auto f = scaled_dot_product_attention(q, k, v, o);
         (void)mha::scaled_dot_product_attention_backward(T({B, H, L, DV}), q, k, v, T({B, H, L, DK}), f.lse, o);
       },
       R"(\b(out|o)\b)"});
  return c;
}

class AttentionBadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(AttentionBadInput, ThrowsErrorNamingTheArgument) { expect_error_naming_the_argument(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, AttentionBadInput, ::testing::ValuesIn(bad_cases()), bad_case_name);

// ---- inputs the headers do not clearly rule in or out -------------------------------------------
// If the call throws, it must be an mha::Error naming the argument; if it succeeds, the result is
// checked where the header implies one. Either way the behaviour is printed for the report.

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
        const NaiveResult want = naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), 4, 4, 0.5, m);
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
  expect_error_if_thrown(
      [&] {
        (void)scaled_dot_product_attention(T({1, 1, 3, 0}), T({1, 1, 5, 0}), T({1, 1, 5, 2}));
      },
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

}  // namespace
}  // namespace mha_test
