// MultiHeadAttention::forward_paged (self-attention decoding over a PagedKVCache) against forward():
// sequences of different lengths decoded together, position by position or a few at a time, give for
// each new position what a causal forward(x, x, x) over that sequence's whole input gives (float64
// within 1e-12 of the scale, float32 within 1e-5, bfloat16 within its precision); a fork continued
// with other inputs leaves its parent's results unchanged; refused calls append nothing.
//
// Legend: n sequences, q_len new positions per call, E = d_model, h heads, h_kv key/value heads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mha/multi_head_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::PagedKVCache;

struct PagedLayerCase {
  const char* name;
  std::int64_t h, h_kv, page_size;
  DType dtype;
  double tolerance;                                 // relative to the output's scale
  mha::KVStorage storage = mha::KVStorage::Native;  // quantized caches: within their rows' rounding
};

void PrintTo(const PagedLayerCase& c, std::ostream* os) { *os << c.name; }

const PagedLayerCase kCases[] = {
    {"float64_grouped_pages_of_3", 4, 2, 3, DType::Float64, 1e-12},
    {"float64_multi_head_pages_of_1", 2, 2, 1, DType::Float64, 1e-12},
    {"float32_multi_query_pages_of_16", 4, 1, 16, DType::Float32, 1e-5},
    {"bfloat16_grouped_pages_of_4", 4, 2, 4, DType::BFloat16, 0x1.0p-5},
    // int8 rows: each element within half a step of max|row| / 127; e4m3: 3 mantissa bits (2^-4 relative)
    {"float32_int8_cache_grouped_pages_of_16", 4, 2, 16, DType::Float32, 0x1.0p-6, mha::KVStorage::Int8},
    {"float32_float8_cache_multi_head_pages_of_5", 2, 2, 5, DType::Float32, 0x1.0p-3, mha::KVStorage::Float8E4M3},
};

MultiHeadAttention make_layer(const PagedLayerCase& c) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 16, cfg.num_heads = c.h, cfg.num_kv_heads = c.h_kv, cfg.dtype = c.dtype, cfg.batch_first = true;
  MultiHeadAttention layer(cfg, 42);
  layer.train(false);
  return layer;
}

// forward(x, x, x) with causal over one sequence's inputs x [T, E]: out [T, E] as doubles.
std::vector<double> full_forward(MultiHeadAttention& layer, const std::vector<double>& x, std::int64_t T, DType dtype) {
  mha::MultiHeadAttentionInputs in;
  in.causal = true;
  in.need_weights = false;
  const Tensor t = make_tensor(dtype, {1, T, 16}, x);
  return to_doubles(layer.forward(t, t, t, in).out);
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

class ForwardPaged : public ::testing::TestWithParam<PagedLayerCase> {};

TEST_P(ForwardPaged, EqualsACausalForwardOverEachWholeSequence) {
  const PagedLayerCase& c = GetParam();
  MultiHeadAttention layer = make_layer(c);
  mha::PagedKVCacheConfig cache_config = layer.paged_cache_config(c.page_size, 256);
  cache_config.storage = c.storage;
  PagedKVCache cache(cache_config);
  Rng rng(7);
  const std::int64_t lengths[] = {9, 4, 13};  // each sequence's whole input
  std::vector<std::vector<double>> inputs;
  for (std::int64_t T : lengths) inputs.push_back(rounded_to(c.dtype, random_values(T * 16, rng)));
  std::vector<PagedKVCache::SequenceId> ids;
  for (std::size_t s = 0; s < inputs.size(); ++s) ids.push_back(cache.add_sequence());
  std::vector<std::vector<double>> got(inputs.size());
  // Steps of q_len = 2, then 1 at a time, every sequence that still has input taking part.
  for (std::int64_t position = 0, q_len = 2; position < 13; position += q_len, q_len = 1) {
    std::vector<PagedKVCache::SequenceId> step_ids;
    std::vector<double> step;
    std::vector<std::size_t> members;
    for (std::size_t s = 0; s < inputs.size(); ++s) {
      if (position + q_len > lengths[s]) continue;
      step_ids.push_back(ids[s]);
      members.push_back(s);
      step.insert(step.end(), inputs[s].begin() + position * 16, inputs[s].begin() + (position + q_len) * 16);
    }
    const auto n = static_cast<std::int64_t>(members.size());
    const Tensor query = make_tensor(c.dtype, {n, q_len, 16}, step);
    const std::vector<double> out = to_doubles(layer.forward_paged(query, cache, step_ids).out);
    for (std::int64_t m = 0; m < n; ++m)
      got[members[static_cast<std::size_t>(m)]].insert(got[members[static_cast<std::size_t>(m)]].end(),
                                                       out.begin() + m * q_len * 16,
                                                       out.begin() + (m + 1) * q_len * 16);
  }
  for (std::size_t s = 0; s < inputs.size(); ++s) {
    ASSERT_EQ(cache.length(ids[s]), lengths[s]) << "sequence " << s;
    const std::vector<double> want = full_forward(layer, inputs[s], lengths[s], c.dtype);
    ASSERT_EQ(got[s].size(), want.size());
    const double bound = c.tolerance * std::max(1.0, max_abs(want));
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[s][i], want[i], bound) << "sequence " << s << " at " << i;
  }
}

TEST_P(ForwardPaged, AForkContinuedOtherwiseLeavesItsParentAlone) {
  const PagedLayerCase& c = GetParam();
  MultiHeadAttention layer = make_layer(c);
  mha::PagedKVCacheConfig cache_config = layer.paged_cache_config(c.page_size, 128);
  cache_config.storage = c.storage;
  PagedKVCache cache(cache_config);
  Rng rng(8);
  const std::vector<double> prefix = rounded_to(c.dtype, random_values(5 * 16, rng));
  const std::vector<double> a = rounded_to(c.dtype, random_values(2 * 16, rng));
  const std::vector<double> b = rounded_to(c.dtype, random_values(2 * 16, rng));
  const PagedKVCache::SequenceId parent = cache.add_sequence();
  (void)layer.forward_paged(make_tensor(c.dtype, {1, 5, 16}, prefix), cache, std::vector{parent});
  const PagedKVCache::SequenceId child = cache.fork(parent);
  const std::vector<PagedKVCache::SequenceId> both{parent, child};
  std::vector<double> step = a;
  step.insert(step.end(), b.begin(), b.end());
  const std::vector<double> out =
      to_doubles(layer.forward_paged(make_tensor(c.dtype, {2, 2, 16}, step), cache, both).out);
  for (int which = 0; which < 2; ++which) {
    std::vector<double> whole = prefix;
    const std::vector<double>& tail = which == 0 ? a : b;
    whole.insert(whole.end(), tail.begin(), tail.end());
    const std::vector<double> want = full_forward(layer, whole, 7, c.dtype);
    const double bound = c.tolerance * std::max(1.0, max_abs(want));
    for (std::int64_t i = 0; i < 2 * 16; ++i)
      EXPECT_NEAR(out[static_cast<std::size_t>(which * 32 + i)], want[static_cast<std::size_t>(5 * 16 + i)], bound)
          << (which == 0 ? "parent" : "child") << " at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ForwardPaged, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<PagedLayerCase>& info) {
                           return std::string(info.param.name);
                         });

void expect_refused_unchanged(const std::function<void()>& call, PagedKVCache& cache, const std::string& fragment) {
  std::vector<std::int64_t> before;
  for (auto s : cache.sequences()) before.push_back(cache.length(s));
  const std::int64_t free_before = cache.free_pages();
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << fragment;
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
  std::vector<std::int64_t> after;
  for (auto s : cache.sequences()) after.push_back(cache.length(s));
  EXPECT_EQ(before, after) << fragment;
  EXPECT_EQ(free_before, cache.free_pages()) << fragment;
}

TEST(ForwardPagedBadInput, RefusedBeforeAnythingIsAppended) {
  const MultiHeadAttention layer = make_layer(kCases[0]);
  PagedKVCache cache(layer.paged_cache_config(3, 9));  // 3 pages of 3 positions
  const auto s0 = cache.add_sequence(), s1 = cache.add_sequence();
  const std::vector<PagedKVCache::SequenceId> one{s0}, two{s0, s1}, twice{s0, s0}, unknown{s0 + 100};
  const Tensor x = make_tensor(DType::Float64, {1, 2, 16}, std::vector<double>(32, 0.5));
  const Tensor x2 = make_tensor(DType::Float64, {2, 4, 16}, std::vector<double>(128, 0.5));
  expect_refused_unchanged([&] { (void)layer.forward_paged(x, cache, two); }, cache, "sequences");
  expect_refused_unchanged([&] { (void)layer.forward_paged(x2, cache, twice); }, cache, "twice");
  expect_refused_unchanged([&] { (void)layer.forward_paged(x, cache, unknown); }, cache, "not in the cache");
  expect_refused_unchanged([&] { (void)layer.forward_paged(x2, cache, two); }, cache, "free pages");  // 4 pages
  expect_refused_unchanged([&] { (void)layer.forward_paged(Tensor::copy_of(x, DType::Float32), cache, one); }, cache,
                           "query");
  mha::MultiHeadAttentionInputs masked;
  masked.causal = true;
  expect_refused_unchanged([&] { (void)layer.forward_paged(x, cache, one, masked); }, cache, "inputs");
  PagedKVCache other(mha::PagedKVCacheConfig{1, 4, 0, 3, 9, DType::Float64});
  const auto o = other.add_sequence();
  expect_refused_unchanged([&] { (void)layer.forward_paged(x, other, std::vector{o}); }, other, "paged_cache_config");
}

}  // namespace
}  // namespace mha_test
