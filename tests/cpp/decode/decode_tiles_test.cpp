// The decode kernel's register tiles (decode_rows-inl.h) and their tails, over every cache storage:
// query rows in tiles of 4 (2 below AVX-512) and the rows left over, keys in tiles of 4 and a block's
// last partial tile, value columns in tiles of 4 vectors and the whole vectors and columns past them;
// against a float64 attention over the dequantized cache (keys() / values()) written here; bitwise the
// same at one and two threads and packed or per head, on every SIMD target. And every int8 and float8
// e4m3 payload widened exactly: a cache of one token decodes to its own values.
//
// Legend: h query heads, h_kv key/value heads, g = h / h_kv, Lq new queries, T tokens, d_k, d_v, P page.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "decode/decode_params.hpp"
#include "decode/quantize.hpp"
#include "mha/mha.hpp"
#include "support/every_target.hpp"

namespace {

using mha::DType;
using mha::KVStorage;
using mha::PagedKVCache;
using mha::Tensor;
using mha::TensorView;

struct Shape {
  std::int64_t h, h_kv, Lq, d_k, d_v, P;
  std::vector<std::int64_t> lengths;
};

// out [n, Lq, h, d_v] of softmax(scale q k^T) v over each sequence's dequantized cache, causal, in float64.
std::vector<double> reference(const std::vector<float>& q, const Shape& s, const PagedKVCache& cache,
                              const std::vector<PagedKVCache::SequenceId>& ids) {
  const std::int64_t n = static_cast<std::int64_t>(ids.size()), g = s.h / s.h_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d_k));
  std::vector<double> out(static_cast<std::size_t>(n * s.Lq * s.h * s.d_v));
  for (std::int64_t b = 0; b < n; ++b) {
    const Tensor keys = cache.keys(ids[b]), values = cache.values(ids[b]);  // [h_kv, T, d]
    const std::int64_t T = s.lengths[b];
    for (std::int64_t i = 0; i < s.Lq; ++i)
      for (std::int64_t head = 0; head < s.h; ++head) {
        const float* qr = q.data() + ((b * s.Lq + i) * s.h + head) * s.d_k;
        const float* k = keys.data_as<float>() + head / g * T * s.d_k;
        const float* v = values.data_as<float>() + head / g * T * s.d_v;
        const std::int64_t seen = T - s.Lq + i + 1;
        std::vector<double> logit(static_cast<std::size_t>(seen));
        double m = -INFINITY, l = 0;
        for (std::int64_t t = 0; t < seen; ++t) {
          double dot = 0;
          for (std::int64_t c = 0; c < s.d_k; ++c) dot += double(qr[c]) * double(k[t * s.d_k + c]);
          logit[t] = scale * dot, m = std::max(m, logit[t]);
        }
        double* o = out.data() + ((b * s.Lq + i) * s.h + head) * s.d_v;
        for (std::int64_t t = 0; t < seen; ++t) {
          const double p = std::exp(logit[t] - m);
          l += p;
          for (std::int64_t c = 0; c < s.d_v; ++c) o[c] += p * double(v[t * s.d_v + c]);
        }
        for (std::int64_t c = 0; c < s.d_v; ++c) o[c] /= l;
      }
  }
  return out;
}

std::vector<float> decode(const std::vector<float>& q, const Shape& s, const PagedKVCache& cache,
                          const std::vector<PagedKVCache::SequenceId>& ids, mha::detail::DecodeMode mode) {
  const TensorView qv(std::span<const float>(q), {static_cast<std::int64_t>(ids.size()), s.Lq, s.h, s.d_k});
  const Tensor out = mha::detail::decode_attention_with_mode(qv, cache, ids, {}, mode).out;
  return {out.data_as<float>(), out.data_as<float>() + out.numel()};
}

// Runs once per SIMD target this CPU supports (support/every_target.hpp): each target reduces a tile's
// dot products by its own tree (decode_rows-inl.h), and the bitwise checks below hold within each.
class DecodeTilesEveryTarget : public mha_test::EveryTarget {};
MHA_INSTANTIATE_EVERY_TARGET(DecodeTilesEveryTarget);

TEST_P(DecodeTilesEveryTarget, RowKeyAndColumnTailsMatchFloat64OverEveryStorage) {
  const Shape shapes[] = {
      {32, 8, 1, 128, 128, 16, {1, 3, 4, 5, 33, 70}},  // g = 4: one row tile; every key-tile tail
      {8, 1, 1, 144, 80, 7, {37, 64}},                 // g = 8: two row tiles; a d_k tail; d_v = 64 + 16
      {6, 2, 2, 7, 200, 1, {2, 9}},                    // R = 6: a tile and rows left over; d_v = 192 + 8
      {3, 3, 1, 16, 16, 256, {300}},                   // one row per kv head: rows alone only
      {10, 2, 3, 64, 48, 5, {3, 41}},                  // R = 15
  };
  std::mt19937 gen(33);
  std::uniform_real_distribution<float> u(-1, 1);
  const int saved = mha::num_threads();
  for (const KVStorage storage : {KVStorage::Native, KVStorage::Int8, KVStorage::Float8E4M3})
    for (const Shape& s : shapes) {
      std::int64_t total = 0;
      for (const std::int64_t T : s.lengths) total += (T + s.P - 1) / s.P * s.P;
      PagedKVCache cache({.num_kv_heads = s.h_kv,
                          .head_dim = s.d_k,
                          .value_dim = s.d_v,
                          .page_size = s.P,
                          .capacity_tokens = total,
                          .storage = storage});
      std::vector<PagedKVCache::SequenceId> ids;
      for (const std::int64_t T : s.lengths) {
        std::vector<float> k(T * s.h_kv * s.d_k), v(T * s.h_kv * s.d_v);
        for (float& x : k) x = u(gen);
        for (float& x : v) x = u(gen);
        ids.push_back(cache.add_sequence());
        cache.append(ids.back(), TensorView(std::span<const float>(k), {T, s.h_kv, s.d_k}),
                     TensorView(std::span<const float>(v), {T, s.h_kv, s.d_v}));
      }
      std::vector<float> q(ids.size() * s.Lq * s.h * s.d_k);
      for (float& x : q) x = 2 * u(gen);
      mha::set_num_threads(1);
      const std::vector<float> one = decode(q, s, cache, ids, mha::detail::DecodeMode::GroupPacked);
      mha::set_num_threads(2);
      const std::vector<float> two = decode(q, s, cache, ids, mha::detail::DecodeMode::GroupPacked);
      const std::vector<float> per_head = decode(q, s, cache, ids, mha::detail::DecodeMode::PerHead);
      const std::vector<double> ref = reference(q, s, cache, ids);
      const std::string what = "storage " + std::to_string(static_cast<int>(storage)) + ", h " + std::to_string(s.h) +
                               ", d_k " + std::to_string(s.d_k) + ", d_v " + std::to_string(s.d_v);
      ASSERT_EQ(std::memcmp(one.data(), two.data(), one.size() * 4), 0) << what;
      ASSERT_EQ(std::memcmp(one.data(), per_head.data(), one.size() * 4), 0) << what;
      double worst = 0;  // values in [-1, 1], logits of a few units: float32 errors of a few 1e-7
      for (std::size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::abs(double(one[i]) - ref[i]));
      EXPECT_LT(worst, 2e-6) << what;
    }
  mha::set_num_threads(saved);
}

// A cache of one token: its weight is 1, so decode returns the token's values, which read back as
// float(payload) * scale; with the scale 1 (a row whose largest magnitude is the payloads' largest)
// that is each payload widened. Head 0 holds the non-negative payloads, head 1 their negatives.
void expect_every_payload_widened(KVStorage storage, const std::vector<float>& magnitudes) {
  const std::int64_t d = static_cast<std::int64_t>(magnitudes.size());
  PagedKVCache cache({.num_kv_heads = 2, .head_dim = d, .page_size = 3, .capacity_tokens = 3, .storage = storage});
  std::vector<float> v(2 * d);
  for (std::int64_t c = 0; c < d; ++c) v[c] = magnitudes[c], v[d + c] = -magnitudes[c];
  const auto id = cache.add_sequence();
  cache.append(id, TensorView(std::span<const float>(v), {1, 2, d}), TensorView(std::span<const float>(v), {1, 2, d}));
  const Tensor values = cache.values(id);
  std::vector<float> q(2 * d, 0.5f);
  const std::vector<PagedKVCache::SequenceId> ids{id};
  const Tensor out = mha::decode_attention(TensorView(std::span<const float>(q), {1, 1, 2, d}), cache, ids).out;
  for (std::int64_t i = 0; i < 2 * d; ++i) {
    ASSERT_EQ(values.data_as<float>()[i], v[i]) << "the scale is 1: the payloads are the values";
    ASSERT_EQ(out.data_as<float>()[i], v[i]) << "element " << i;
  }
}

TEST(DecodeTiles, EveryFloat8PayloadIsWidenedExactly) {
  std::vector<float> magnitudes;  // every finite e4m3 magnitude, subnormals included: patterns 0 .. 0x7E
  for (int bits = 0; bits <= mha::detail::kE4M3MaxBits; ++bits) {
    double value = bits < 8 ? std::ldexp(bits, -9) : std::ldexp(1.0 + (bits % 8) / 8.0, bits / 8 - 7);
    magnitudes.push_back(static_cast<float>(value));
  }
  ASSERT_EQ(magnitudes.back(), 448.0f);
  magnitudes.push_back(448.0f);  // 128 columns: a whole number of vectors, so the tiles read them all
  expect_every_payload_widened(KVStorage::Float8E4M3, magnitudes);
  magnitudes.resize(127);  // and 127: the columns past the last whole vector
  expect_every_payload_widened(KVStorage::Float8E4M3, magnitudes);
}

TEST(DecodeTiles, EveryInt8PayloadIsWidenedExactly) {
  std::vector<float> magnitudes;
  for (int q = 0; q <= 127; ++q) magnitudes.push_back(static_cast<float>(q));
  expect_every_payload_widened(KVStorage::Int8, magnitudes);  // 128 columns
}

}  // namespace
