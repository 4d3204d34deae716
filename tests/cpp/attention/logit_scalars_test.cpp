// The numbers a logit is formed with (scale, softcap, ALiBi slopes) at the public boundary (issue 30):
// scaled_dot_product_attention, its backward, MultiHeadAttention's forward and decode_attention refuse
// a value that is not 0 or a normal finite number of the logit dtype (float32 for float32 and bfloat16
// inputs, float64 for float64), naming the argument and the range, where it used to become inf (every
// output NaN) or 0 (softcap 5e-324: the cap dropped); values at the ends of the range give the float64
// answer.
//
// Legend: B batch, h heads, L queries, S keys, d_k, d_v.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "mha/decode.hpp"
#include "mha/multi_head_attention.hpp"
#include "support/message_matches.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;

constexpr std::int64_t B = 1, H = 2, L = 3, S = 4, D = 4;
constexpr double kF32Min = std::numeric_limits<float>::min(), kF32Max = std::numeric_limits<float>::max();
constexpr double kF64Min = std::numeric_limits<double>::min(), kDenormMin = std::numeric_limits<double>::denorm_min();

// A double as a test's name shows it: "1e+39", "nan".
std::string str(double x) {
  std::ostringstream out;
  out << x;
  return out.str();
}

// `call` throws mha::Error whose message matches `pattern`.
void expect_refused(const std::function<void()>& call, const std::string& pattern, const std::string& what) {
  try {
    call();
    ADD_FAILURE() << what << ": accepted; expected an error matching /" << pattern << "/";
  } catch (const mha::Error& e) {
    EXPECT_TRUE(message_matches(e.what(), pattern.c_str())) << what << ": " << e.what();
  }
}

// Values outside the logit range of `dtype`, both signs (softcap: negative ones are refused in any case).
std::vector<double> outside(DType dtype) {
  std::vector<double> v{kInf, kNaN};
  if (dtype == DType::Float64) {
    v.insert(v.end(), {kDenormMin, std::nextafter(kF64Min, 0.0)});
  } else {
    v.insert(v.end(), {1e39, 1e300, std::nextafter(kF32Max, kInf), std::nextafter(kF32Min, 0.0), 1e-40, kDenormMin});
  }
  const std::size_t n = v.size();
  for (std::size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return v;
}

std::string range_pattern(DType dtype) {
  return dtype == DType::Float64 ? "normal float64 numbers" : "normal float32 numbers";
}

// q [1, 2, 3, 4], k and v [1, 2, 4, 4] of `dtype`.
struct Inputs {
  Tensor q, k, v;
  explicit Inputs(DType dtype, std::uint64_t seed = 7) {
    Rng rng(seed);
    q = random_tensor(dtype, {B, H, L, D}, rng);
    k = random_tensor(dtype, {B, H, S, D}, rng);
    v = random_tensor(dtype, {B, H, S, D}, rng);
  }
};

// The options with `argument` set to `value` (alibi_slopes: the second head's slope; `slopes` keeps them).
AttentionOptions with(const std::string& argument, double value, Tensor& slopes) {
  AttentionOptions o;
  if (argument == "scale") o.scale = value;
  if (argument == "softcap") o.softcap = value;
  if (argument == "alibi_slopes") {
    slopes = make_tensor(DType::Float64, {H}, {0.5, value});
    o.alibi_slopes = slopes.view();
  }
  return o;
}

class LogitScalars : public ::testing::TestWithParam<DType> {};

TEST_P(LogitScalars, OutsideTheLogitDtypeRefusedByNameForwardAndBackward) {
  const DType dtype = GetParam();
  const Inputs in(dtype);
  AttentionOptions plain;
  plain.need_lse = true;
  const mha::AttentionResult f = mha::scaled_dot_product_attention(in.q, in.k, in.v, plain);
  for (const char* argument : {"scale", "softcap", "alibi_slopes"})
    for (double value : outside(dtype)) {
      Tensor slopes;
      const AttentionOptions o = with(argument, value, slopes);
      const std::string pattern = std::string("^") + argument + ": expected .*" + range_pattern(dtype);
      const std::string what = std::string(argument) + " = " + str(value);
      expect_refused([&] { (void)mha::scaled_dot_product_attention(in.q, in.k, in.v, o); }, pattern, what);
      expect_refused(
          [&] { (void)mha::scaled_dot_product_attention_backward(f.out, in.q, in.k, in.v, f.out, f.lse, o); }, pattern,
          what + " (backward)");
    }
}

TEST_P(LogitScalars, NegativeSoftcapRefused) {
  const Inputs in(GetParam());
  AttentionOptions o;
  o.softcap = -1.0;
  expect_refused([&] { (void)mha::scaled_dot_product_attention(in.q, in.k, in.v, o); },
                 "^softcap: expected 0 \\(none\\)", "softcap = -1");
}

// At the ends of the float32 range (and, for float64 inputs, far beyond it): accepted, and the result is
// the float64 answer of the same inputs.
TEST_P(LogitScalars, EndsOfTheRangeGiveTheFloat64Answer) {
  const DType dtype = GetParam();
  const Inputs in(dtype, 11);
  struct Case {
    const char* argument;
    double value;
  };
  std::vector<Case> cases{{"scale", 0.0},       {"scale", kF32Min},        {"scale", -1e30},
                          {"scale", 1e30},      {"softcap", kF32Min},      {"softcap", 1e-30},
                          {"softcap", kF32Max}, {"alibi_slopes", kF32Max}, {"alibi_slopes", -kF32Min},
                          {"alibi_slopes", 0.0}};
  if (dtype == DType::Float64)
    cases.insert(cases.end(), {{"scale", 1e39}, {"scale", 1e-300}, {"softcap", 1e300}, {"alibi_slopes", 1e300}});
  for (const Case& c : cases) {
    Tensor slopes;
    const AttentionOptions o = with(c.argument, c.value, slopes);
    const std::string what = std::string(c.argument) + " = " + str(c.value);
    const mha::AttentionResult r = mha::scaled_dot_product_attention(in.q, in.k, in.v, o);
    NaiveMaskSpec m;
    m.B = B, m.h = H, m.L = L, m.S = S;
    if (o.alibi_slopes) m.alibi_slopes = to_doubles(*o.alibi_slopes);
    m.softcap = o.softcap;
    const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
    const NaiveResult want = naive_attention(to_doubles(in.q), to_doubles(in.k), to_doubles(in.v), D, D, scale, m);
    const double tolerance = dtype == DType::Float64 ? 1e-12 : dtype == DType::Float32 ? 1e-5 : 2e-2;
    EXPECT_TRUE(all_close(to_doubles(r.out), want.out, tolerance, tolerance)) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LogitScalars, ::testing::Values(DType::Float32, DType::BFloat16, DType::Float64),
                         [](const ::testing::TestParamInfo<DType>& info) { return short_name(info.param); });

TEST(LogitScalarsLayer, SoftcapAndSlopesOutsideTheLogitDtypeRefusedByName) {
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Float64}) {
    mha::MultiHeadAttentionConfig c;
    c.d_model = 8, c.num_heads = H, c.batch_first = true, c.dtype = dtype;
    mha::MultiHeadAttention layer(c, 3);
    Rng rng(5);
    const Tensor x = random_tensor(dtype, {B, S, 8}, rng);
    for (double value : outside(dtype)) {
      mha::MultiHeadAttentionInputs softcap;
      softcap.softcap = value;
      expect_refused([&] { (void)layer.forward(x, x, x, softcap); }, "^softcap: expected .*" + range_pattern(dtype),
                     "layer softcap = " + str(value));
      const Tensor slopes = make_tensor(DType::Float64, {H}, {value, 0.25});
      mha::MultiHeadAttentionInputs alibi;
      alibi.alibi_slopes = slopes.view();
      expect_refused([&] { (void)layer.forward(x, x, x, alibi); },
                     "^alibi_slopes: expected .*" + range_pattern(dtype) + ".*for head 0",
                     "layer alibi slope = " + str(value));
    }
  }
}

TEST(LogitScalarsDecode, ScaleOutsideTheLogitDtypeRefusedByName) {
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Float64}) {
    mha::PagedKVCache cache({.num_kv_heads = 1, .head_dim = D, .page_size = 2, .capacity_tokens = 8, .dtype = dtype});
    const auto s = cache.add_sequence();
    Rng rng(9);
    const Tensor kv = random_tensor(dtype, {3, 1, D}, rng);
    cache.append(s, kv, kv);
    const Tensor q = random_tensor(dtype, {1, 1, 2, D}, rng);
    const std::vector<mha::PagedKVCache::SequenceId> ids{s};
    for (double value : outside(dtype)) {
      mha::DecodeOptions o;
      o.scale = value;
      expect_refused([&] { (void)mha::decode_attention(q, cache, ids, o); },
                     "^decode_attention: scale: expected .*" + range_pattern(dtype), "decode scale = " + str(value));
    }
    mha::DecodeOptions tiny;  // 0 and the ends of the range are accepted
    for (double value : {0.0, kF32Min, kF32Max}) {
      tiny.scale = value;
      EXPECT_NO_THROW((void)mha::decode_attention(q, cache, ids, tiny)) << value;
    }
  }
}

}  // namespace
}  // namespace mha_test
