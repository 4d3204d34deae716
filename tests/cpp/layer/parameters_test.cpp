// MultiHeadAttention parameters: names in PyTorch's state_dict order, shapes (packed and separate
// projections, d_k != d_v, h*d_k != d_model, no bias, add_bias_kv), the resolved config,
// initialisation (seeded, zero biases, xavier bounds), set_parameter, state_dict and the strictness of
// load_state_dict.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;

struct ParamCase {
  const char* name;
  std::int64_t E, h, d_k, d_v, kdim, vdim;  // as given to the config (0 = default)
  bool bias, add_bias_kv;
  DType dtype;

  MultiHeadAttentionConfig config() const {
    MultiHeadAttentionConfig c;
    c.d_model = E, c.num_heads = h, c.d_k = d_k, c.d_v = d_v, c.kdim = kdim, c.vdim = vdim;
    c.bias = bias, c.add_bias_kv = add_bias_kv, c.dtype = dtype;
    return c;
  }
  // The header's defaults, resolved here.
  std::int64_t rd_k() const { return d_k ? d_k : E / h; }
  std::int64_t rd_v() const { return d_v ? d_v : E / h; }
  std::int64_t rkdim() const { return kdim ? kdim : E; }
  std::int64_t rvdim() const { return vdim ? vdim : E; }
  bool packed() const { return rkdim() == E && rvdim() == E && rd_k() == rd_v(); }
  std::vector<ExpectedParam> expected() const {
    return expected_parameters(E, h, rd_k(), rd_v(), rkdim(), rvdim(), bias, add_bias_kv);
  }
};

void PrintTo(const ParamCase& c, std::ostream* os) { *os << c.name; }

const ParamCase kParamCases[] = {
    {"packed_E12_h3", 12, 3, 0, 0, 0, 0, true, false, DType::Float32},
    {"packed_E12_h2_dk5_hdk_ne_E", 12, 2, 5, 5, 0, 0, true, false, DType::Float32},
    {"packed_kdim_vdim_given_equal_E", 8, 2, 0, 0, 8, 8, true, false, DType::Float32},
    {"separate_dk4_dv6", 12, 3, 4, 6, 0, 0, true, false, DType::Float32},
    {"separate_kdim5_vdim7", 8, 2, 0, 0, 5, 7, true, false, DType::Float32},
    {"separate_kdim_only", 8, 2, 0, 0, 3, 0, true, false, DType::Float32},
    {"packed_nobias", 12, 3, 0, 0, 0, 0, false, false, DType::Float32},
    {"packed_bias_kv", 12, 3, 0, 0, 0, 0, true, true, DType::Float32},
    {"separate_E10_h3_dk4_dv2_nobias_bias_kv", 10, 3, 4, 2, 0, 0, false, true, DType::Float32},
    {"separate_kdim6_bias_kv_dk3_dv5", 8, 4, 3, 5, 6, 9, true, true, DType::Float64},
    {"f64_packed_E16_h4", 16, 4, 0, 0, 0, 0, true, false, DType::Float64},
    {"f64_packed_E8_h8_dk1", 8, 8, 0, 0, 0, 0, true, true, DType::Float64},
};

class MhaParams : public ::testing::TestWithParam<ParamCase> {};
INSTANTIATE_TEST_SUITE_P(Configs, MhaParams, ::testing::ValuesIn(kParamCases),
                         [](const ::testing::TestParamInfo<ParamCase>& info) { return std::string(info.param.name); });

TEST_P(MhaParams, NamesShapesAndResolvedConfig) {
  const ParamCase& c = GetParam();
  MultiHeadAttention m(c.config(), 3);
  const auto& cfg = m.config();
  EXPECT_EQ(cfg.d_model, c.E);
  EXPECT_EQ(cfg.num_heads, c.h);
  EXPECT_EQ(cfg.d_k, c.rd_k());
  EXPECT_EQ(cfg.d_v, c.rd_v());
  EXPECT_EQ(cfg.kdim, c.rkdim());
  EXPECT_EQ(cfg.vdim, c.rvdim());
  EXPECT_EQ(cfg.bias, c.bias);
  EXPECT_EQ(cfg.add_bias_kv, c.add_bias_kv);
  EXPECT_EQ(cfg.dtype, c.dtype);
  EXPECT_EQ(m.packed_in_proj(), c.packed());

  std::vector<std::string> want_names;
  for (const auto& p : c.expected()) want_names.push_back(p.name);
  EXPECT_EQ(m.parameter_names(), want_names);
  for (const auto& p : c.expected()) {
    SCOPED_TRACE(p.name);
    const Tensor& t = m.parameter(p.name);
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.shape(), p.shape);
    EXPECT_EQ(t.dtype(), c.dtype);
  }

  const auto sd = m.state_dict();
  std::vector<std::string> sd_names;
  for (const auto& [name, view] : sd) sd_names.push_back(name);
  std::vector<std::string> sorted = want_names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sd_names, sorted);
  for (const auto& [name, view] : sd) {
    SCOPED_TRACE(name);
    EXPECT_EQ(view.data(), m.parameter(name).data()) << "state_dict must view the parameters";
    EXPECT_EQ(view.shape(), m.parameter(name).shape());
    EXPECT_EQ(view.dtype(), c.dtype);
  }
}

TEST_P(MhaParams, SetParameterIsSeenEverywhereAndConvertsDtype) {
  const ParamCase& c = GetParam();
  MultiHeadAttention m(c.config(), 3);
  Rng rng(31);
  const DType other = c.dtype == DType::Float32 ? DType::Float64 : DType::Float32;
  for (const auto& p : c.expected()) {
    SCOPED_TRACE(p.name);
    const std::vector<double> vals = random_values(mha::shape_numel(p.shape), rng);
    Tensor src = make_tensor(other, p.shape, vals);
    m.set_parameter(p.name, src);
    const std::vector<double> want = rounded_to(c.dtype, rounded_to(other, vals));
    EXPECT_EQ(m.parameter(p.name).dtype(), c.dtype);
    EXPECT_EQ(to_doubles(m.parameter(p.name)), want);
    EXPECT_EQ(to_doubles(m.state_dict().at(p.name)), want);
  }
}

TEST_P(MhaParams, StateDictRoundTrip) {
  const ParamCase& c = GetParam();
  MultiHeadAttention a(c.config(), 1);
  MultiHeadAttention b(c.config(), 2);
  b.load_state_dict(a.state_dict());
  for (const auto& name : a.parameter_names()) EXPECT_TRUE(bitwise_equal(a.parameter(name), b.parameter(name))) << name;
}

// A snapshot of every parameter, to check that a failed call changed nothing.
std::map<std::string, Tensor> snapshot(const MultiHeadAttention& m) {
  std::map<std::string, Tensor> s;
  for (const auto& name : m.parameter_names()) s.emplace(name, m.parameter(name).clone());
  return s;
}
void expect_unchanged(const MultiHeadAttention& m, const std::map<std::string, Tensor>& before) {
  for (const auto& [name, t] : before) EXPECT_TRUE(bitwise_equal(m.parameter(name), t)) << name << " changed";
}

// load_state_dict throws mha::Error naming the entry and changes nothing, whichever entry is bad
// (including one that sorts after valid entries that would otherwise have been written first).
TEST_P(MhaParams, LoadStateDictIsStrictAndAtomic) {
  const ParamCase& c = GetParam();
  MultiHeadAttention m(c.config(), 4);
  const auto before = snapshot(m);
  Rng rng(32);
  const auto expected = c.expected();
  for (std::size_t bad = 0; bad < expected.size(); ++bad) {
    for (const char* kind : {"missing", "misshaped", "wrong_rank"}) {
      SCOPED_TRACE(std::string(kind) + " " + expected[bad].name);
      std::vector<Tensor> keep;
      std::map<std::string, TensorView> state;
      for (std::size_t i = 0; i < expected.size(); ++i) {
        Shape shape = expected[i].shape;
        if (i == bad) {
          if (std::string(kind) == "missing") continue;
          if (std::string(kind) == "misshaped") shape.back() += 1;
          if (std::string(kind) == "wrong_rank") shape.push_back(1);
        }
        keep.push_back(random_tensor(c.dtype, shape, rng));
        state.emplace(expected[i].name, keep.back().view());
      }
      try {
        m.load_state_dict(state);
        ADD_FAILURE() << "no exception";
      } catch (const mha::Error& e) {
        EXPECT_NE(std::string(e.what()).find(expected[bad].name), std::string::npos) << e.what();
      }
      expect_unchanged(m, before);
    }
  }
  // An unknown extra entry, alongside a complete valid set.
  for (const char* extra : {"aaa_unknown", "zzz_unknown", "out_proj.weight_typo"}) {
    SCOPED_TRACE(extra);
    std::vector<Tensor> keep;
    std::map<std::string, TensorView> state;
    for (const auto& p : expected) {
      keep.push_back(random_tensor(c.dtype, p.shape, rng));
      state.emplace(p.name, keep.back().view());
    }
    keep.push_back(random_tensor(c.dtype, {2}, rng));
    state.emplace(extra, keep.back().view());
    try {
      m.load_state_dict(state);
      ADD_FAILURE() << "no exception";
    } catch (const mha::Error& e) {
      EXPECT_NE(std::string(e.what()).find(extra), std::string::npos) << e.what();
    }
    expect_unchanged(m, before);
  }
}

TEST(MhaParamsLoad, ConvertsFloat32StateIntoFloat64Module) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 8, cfg.num_heads = 2, cfg.dtype = DType::Float64;
  MultiHeadAttention m(cfg);
  Rng rng(33);
  RandomState rs = random_state(8, 2, 4, 4, 8, 8, true, false, false, DType::Float32, rng);
  m.load_state_dict(rs.views());
  for (const auto& [name, t] : rs.tensors) {
    EXPECT_EQ(m.parameter(name).dtype(), DType::Float64) << name;
    EXPECT_EQ(to_doubles(m.parameter(name)), to_doubles(t)) << name;
  }
}

// Initialisation: seeded, biases exactly 0, weights inside (and filling) the xavier / 1/sqrt(fan_in)
// bounds of the header, bias_k / bias_v xavier_normal.
struct InitCase {
  const char* name;
  ParamCase p;
};

void PrintTo(const InitCase& c, std::ostream* os) { *os << c.name; }

class MhaInit : public ::testing::TestWithParam<InitCase> {};

// max |w| <= bound, and (with enough samples) max |w| >= 0.8 bound and mean |w| ~ bound / 2.
void expect_uniform_within(const std::string& name, const std::vector<double>& w, double bound) {
  SCOPED_TRACE(name + " bound " + std::to_string(bound));
  double max_abs = 0, sum_abs = 0, sum = 0;
  for (double x : w) {
    ASSERT_TRUE(std::isfinite(x));
    max_abs = std::max(max_abs, std::fabs(x));
    sum_abs += std::fabs(x);
    sum += x;
  }
  const double n = static_cast<double>(w.size());
  EXPECT_LE(max_abs, bound * (1 + 1e-6));
  if (w.size() >= 200) {
    EXPECT_GE(max_abs, 0.8 * bound) << "values do not fill the bound: a narrower distribution";
    EXPECT_NEAR(sum_abs / n, bound / 2, 0.1 * bound) << "mean |w|";
    EXPECT_NEAR(sum / n, 0.0, 0.1 * bound) << "mean";
  }
}

TEST_P(MhaInit, SeededZeroBiasesXavierBounds) {
  const ParamCase& c = GetParam().p;
  MultiHeadAttention a(c.config(), 11), b(c.config(), 11), other(c.config(), 12);
  for (const auto& name : a.parameter_names())
    EXPECT_TRUE(bitwise_equal(a.parameter(name), b.parameter(name))) << name << ": same seed must give same values";
  const std::string first_weight = c.packed() ? "in_proj_weight" : "q_proj_weight";
  EXPECT_FALSE(bitwise_equal(a.parameter(first_weight), other.parameter(first_weight))) << "seed ignored";
  EXPECT_FALSE(bitwise_equal(a.parameter("out_proj.weight"), other.parameter("out_proj.weight"))) << "seed ignored";

  const std::int64_t h = c.h, d_k = c.rd_k(), d_v = c.rd_v();
  auto xavier = [](double fan_in, double fan_out) { return std::sqrt(6.0 / (fan_in + fan_out)); };
  std::vector<double> bias_kv_samples;
  for (const auto& p : c.expected()) {
    const auto w = to_doubles(a.parameter(p.name));
    if (p.name == "in_proj_bias" || p.name == "out_proj.bias") {
      EXPECT_EQ(w, std::vector<double>(w.size(), 0.0)) << p.name << " must start at 0";
    } else if (p.name == "in_proj_weight") {
      // PyTorch applies xavier_uniform to the whole packed [rows, E] matrix.
      expect_uniform_within(p.name, w, xavier(static_cast<double>(c.E), static_cast<double>(2 * h * d_k + h * d_v)));
    } else if (p.name == "q_proj_weight" || p.name == "k_proj_weight" || p.name == "v_proj_weight") {
      expect_uniform_within(p.name, w, xavier(static_cast<double>(p.shape[1]), static_cast<double>(p.shape[0])));
    } else if (p.name == "out_proj.weight") {
      expect_uniform_within(p.name, w, 1.0 / std::sqrt(static_cast<double>(h * d_v)));
    } else if (p.name == "bias_k" || p.name == "bias_v") {
      EXPECT_TRUE(all_finite(w));
      double ss = 0;
      for (double x : w) ss += x * x;
      EXPECT_GT(ss, 0.0) << p.name << " must not start at 0";
      bias_kv_samples.insert(bias_kv_samples.end(), w.begin(), w.end());
    }
  }
  // xavier_normal on [1, 1, n]: fan_in = fan_out = n, so std = sqrt(2 / (2n)) = 1 / sqrt(n). Checked
  // when d_k == d_v and there are enough samples to tell it from e.g. sqrt(2 / n).
  if (c.add_bias_kv && d_k == d_v && bias_kv_samples.size() >= 400) {
    double ss = 0;
    for (double x : bias_kv_samples) ss += x * x;
    const double std_dev = std::sqrt(ss / static_cast<double>(bias_kv_samples.size()));
    const double want = 1.0 / std::sqrt(static_cast<double>(h * d_k));
    EXPECT_NEAR(std_dev / want, 1.0, 0.2) << "bias_k / bias_v standard deviation " << std_dev << ", expected " << want;
  }
}

const InitCase kInitCases[] = {
    {"packed_E64_h4", {"", 64, 4, 0, 0, 0, 0, true, false, DType::Float32}},
    {"f64_packed_E48_h3", {"", 48, 3, 0, 0, 0, 0, true, false, DType::Float64}},
    {"separate_E32_dk8_dv16_kdim24_vdim40", {"", 32, 4, 8, 16, 24, 40, true, false, DType::Float32}},
    {"packed_bias_kv_E64_h8_dk32", {"", 64, 8, 32, 32, 0, 0, true, true, DType::Float32}},
    {"packed_hdk_ne_E_E20_h3_dk10", {"", 20, 3, 10, 10, 0, 0, true, false, DType::Float64}},
};
INSTANTIATE_TEST_SUITE_P(Configs, MhaInit, ::testing::ValuesIn(kInitCases),
                         [](const ::testing::TestParamInfo<InitCase>& info) { return std::string(info.param.name); });

TEST(MhaModes, TrainingIsTheDefaultAndToggles) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2;
  MultiHeadAttention m(cfg);
  EXPECT_TRUE(m.training());
  m.eval();
  EXPECT_FALSE(m.training());
  m.train();
  EXPECT_TRUE(m.training());
  m.train(false);
  EXPECT_FALSE(m.training());
  for (mha::Kernel kernel : kAllKernels) {
    m.set_kernel(kernel);
    EXPECT_EQ(m.kernel(), kernel) << kernel_name(kernel);
  }
}

TEST(MhaConfig, DefaultsMatchTheHeader) {
  MultiHeadAttentionConfig cfg;
  EXPECT_TRUE(cfg.bias);
  EXPECT_FALSE(cfg.add_bias_kv);
  EXPECT_FALSE(cfg.add_zero_attn);
  EXPECT_EQ(cfg.dropout, 0.0);
  EXPECT_TRUE(cfg.batch_first);
  EXPECT_EQ(cfg.dtype, DType::Float32);
}

}  // namespace
}  // namespace mha_test
