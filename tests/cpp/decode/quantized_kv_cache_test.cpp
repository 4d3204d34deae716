// The quantized storage of PagedKVCache (KVStorage::Int8 and ::Float8E4M3, decode/quantize.hpp):
// float8 e4m3 widened exactly on all 256 patterns against the format's definition written out here;
// the rounding to e4m3 (nearest, ties to even, saturating) at every midpoint between neighbours; the
// scale rule; the int8 and e4m3 quantizers on random rows of every magnitude (against std::nearbyint
// and a nearest-pattern search) and on edge rows (all zero, one huge element, NaN / Inf, float64 beyond
// float32, subnormal scales); the page layout (payloads, scales, alignment) and what append, fork and
// copy-on-write put there; refusals by name.
//
// Legend: h_kv key/value heads, d_k, d_v, P tokens per page, d a row's width.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "decode/quantize.hpp"
#include "mha/error.hpp"
#include "mha/paged_kv_cache.hpp"

namespace {

using mha::DType;
using mha::KVStorage;
using mha::PagedKVCache;
using mha::Tensor;
using mha::TensorView;
namespace detail = mha::detail;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kFloatMax = std::numeric_limits<float>::max();

// The value of float8 e4m3 (fn) pattern S.EEEE.MMM from the format's definition: bias 7, no
// infinities, S.1111.111 NaN; E > 0: (1 + M/8) 2^(E-7); E = 0: (M/8) 2^-6.
double e4m3_definition(unsigned bits) {
  const double sign = (bits & 0x80) ? -1.0 : 1.0;
  const unsigned e = (bits >> 3) & 0xF, m = bits & 0x7;
  if (e == 0xF && m == 0x7) return kNaN;
  if (e == 0) return sign * (m / 8.0) * std::pow(2.0, -6);
  return sign * (1.0 + m / 8.0) * std::pow(2.0, static_cast<double>(e) - 7);
}

// y rounded to e4m3 by searching the 127 non-negative finite patterns for the nearest (ties: the even
// pattern), |y| beyond 448 saturating: the oracle for e4m3_from_double, as a value.
double nearest_e4m3(double y) {
  const double a = std::min(std::fabs(y), 448.0);
  unsigned best = 0;
  for (unsigned b = 1; b <= 0x7E; ++b) {
    const double d = std::fabs(e4m3_definition(b) - a), d_best = std::fabs(e4m3_definition(best) - a);
    if (d < d_best || (d == d_best && b % 2 == 0)) best = b;
  }
  return std::copysign(e4m3_definition(best), y);
}

mha::PagedKVCacheConfig quantized(KVStorage storage, std::int64_t h, std::int64_t P, std::int64_t d_k, std::int64_t d_v,
                                  std::int64_t capacity) {
  return {.num_kv_heads = h,
          .head_dim = d_k,
          .value_dim = d_v,
          .page_size = P,
          .capacity_tokens = capacity,
          .dtype = DType::Float32,
          .storage = storage};
}

std::int64_t aligned(std::int64_t bytes, std::int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const mha::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Quantize, E4M3ToFloatOnAll256PatternsIsTheFormatsDefinition) {
  for (unsigned bits = 0; bits < 256; ++bits) {
    const double expected = e4m3_definition(bits);
    const float got = detail::e4m3_to_float(static_cast<std::uint8_t>(bits));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << bits;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), expected) << "pattern " << bits;  // exact: widened, not rounded
    EXPECT_EQ(std::signbit(got), (bits & 0x80) != 0) << bits;
  }
  EXPECT_EQ(detail::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(detail::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(detail::e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(detail::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(detail::e4m3_to_float(0xFE), -448.0f);
}

TEST(Quantize, E4M3FromDoubleRoundsToNearestTiesToEvenAndSaturates) {
  for (unsigned b = 0; b <= 0x7E; ++b) {  // every finite value maps to its own pattern, either sign
    EXPECT_EQ(detail::e4m3_from_double(e4m3_definition(b)), b) << b;
    EXPECT_EQ(detail::e4m3_from_double(-e4m3_definition(b)), b | 0x80) << b;
  }
  for (unsigned b = 0; b < 0x7E; ++b) {  // between neighbours: the midpoint goes to the even pattern
    const double mid = (e4m3_definition(b) + e4m3_definition(b + 1)) / 2;
    EXPECT_EQ(detail::e4m3_from_double(mid), b % 2 == 0 ? b : b + 1) << "midpoint after " << b;
    EXPECT_EQ(detail::e4m3_from_double(std::nextafter(mid, 0.0)), b) << b;
    EXPECT_EQ(detail::e4m3_from_double(std::nextafter(mid, 1e9)), b + 1) << b;
    EXPECT_EQ(detail::e4m3_from_double(-std::nextafter(mid, 1e9)), (b + 1) | 0x80) << b;
  }
  for (double big : {448.0, 449.0, 464.0, 480.0, 1e300, std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(detail::e4m3_from_double(big), 0x7E) << big;  // saturates: never NaN from a number
    EXPECT_EQ(detail::e4m3_from_double(-big), 0xFE) << big;
  }
  EXPECT_EQ(detail::e4m3_from_double(kNaN) & 0x7F, 0x7F);
  EXPECT_EQ(detail::e4m3_from_double(std::ldexp(1.0, -10)), 0x00);  // half the smallest: ties to 0
  EXPECT_EQ(detail::e4m3_from_double(1e-300), 0x00);
  EXPECT_EQ(detail::e4m3_from_double(-0.0), 0x80);
}

TEST(Quantize, RoundHalfEvenRoundsTiesToTheEvenInteger) {
  const double cases[][2] = {{0.5, 0},
                             {1.5, 2},
                             {2.5, 2},
                             {-0.5, -0},
                             {-1.5, -2},
                             {126.5, 126},
                             {127.5, 128},
                             {-126.5, -126},
                             {0.49999999999999994, 0},
                             {2.5000000000000004, 3},
                             {-7.2, -7}};
  for (const auto& [v, expected] : cases) EXPECT_EQ(detail::round_half_even(v), expected) << v;
}

TEST(Quantize, TheScaleIsMaxOverQmaxTo17BitsOrAMultipleOfTheSmallestFloat) {
  std::mt19937 gen(1);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  for (double qmax : {detail::kInt8PayloadMax, detail::kE4M3PayloadMax})
    for (int e = -149; e <= 127; ++e)
      for (int i = 0; i < 8; ++i) {
        const double m = std::min(static_cast<double>(static_cast<float>(std::ldexp(mantissa(gen), e))), kFloatMax);
        if (m == 0) continue;
        const double s = detail::quantization_scale(m, qmax), exact = m / qmax;
        ASSERT_TRUE(s > 0 && std::isfinite(s)) << m;
        if (exact >= std::ldexp(1.0, -133)) {
          EXPECT_TRUE(s <= exact && s >= exact * (1 - std::ldexp(1.0, -16))) << m << " " << s;
          const double steps = s / std::ldexp(1.0, std::ilogb(s) - 16);  // 17 significant bits: an integer
          EXPECT_EQ(steps, std::floor(steps)) << s;
          EXPECT_LT(m / s, qmax + 0.5) << m;  // no payload needs clamping
        } else {
          EXPECT_TRUE(s >= exact && s < exact + std::ldexp(1.0, -149)) << m << " " << s;
          EXPECT_LE(m / s, qmax) << m;
        }
      }
}

// Random rows [d] of every binary magnitude, float and double, quantized to int8: |q| <= 127,
// q = nearbyint(x / s) (the default rounding mode: ties to even), x' = q s exact in float32 and within s / 2
// of x; the row's largest element at +-127 wherever the scale has 17 bits.
TEST(Quantize, Int8RowsOfEveryMagnitudeStayWithinHalfAStep) {
  std::mt19937 gen(2);
  std::uniform_real_distribution<double> u(-1, 1);
  constexpr std::int64_t d = 37;
  for (int e = -149; e <= 128; e += 3)
    for (bool as_double : {false, true}) {
      std::vector<float> xf(d);
      std::vector<double> x(d);
      for (std::int64_t c = 0; c < d; ++c) {
        xf[c] = static_cast<float>(std::min(std::ldexp(u(gen), e), kFloatMax));
        x[c] = as_double ? std::min(std::ldexp(u(gen), e), kFloatMax) : xf[c];
      }
      std::vector<std::int8_t> q(d);
      const float s = as_double ? detail::quantize_int8_row(x.data(), d, q.data())
                                : detail::quantize_int8_row(xf.data(), d, q.data());
      double m = 0;
      for (double v : x) m = std::max(m, std::fabs(v));
      if (m == 0) continue;
      ASSERT_TRUE(s > 0) << e;
      int largest = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        const float back = detail::dequantize_int8(q[c], s);
        EXPECT_EQ(q[c], std::nearbyint(x[c] / s)) << e << " " << c;
        EXPECT_EQ(static_cast<double>(back), q[c] * static_cast<double>(s)) << "inexact product at " << e;
        EXPECT_LE(std::fabs(back - x[c]), s / 2.0) << e << " " << c;
        largest = std::max(largest, std::abs(static_cast<int>(q[c])));
      }
      EXPECT_LE(largest, 127);
      if (m / 127 >= std::ldexp(1.0, -133)) {
        EXPECT_EQ(largest, 127) << e;
      }
    }
}

TEST(Quantize, E4M3RowsAreTheNearestPatternTimesTheScale) {
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> u(-1, 1);
  constexpr std::int64_t d = 29;
  for (int e = -149; e <= 128; e += 5) {
    std::vector<double> x(d);
    for (double& v : x) v = static_cast<float>(std::min(std::ldexp(u(gen), e), kFloatMax));
    std::vector<std::uint8_t> q(d);
    const float s = detail::quantize_e4m3_row(x.data(), d, q.data());
    for (std::int64_t c = 0; c < d; ++c) {
      EXPECT_EQ(static_cast<double>(detail::e4m3_to_float(q[c])), nearest_e4m3(x[c] / s)) << e << " " << c;
      EXPECT_EQ(detail::dequantize_e4m3(q[c], s), detail::e4m3_to_float(q[c]) * s);
      EXPECT_NE(q[c] & 0x7F, 0x7F) << "NaN from a finite row";
    }
  }
}

TEST(Quantize, EdgeRows) {
  std::vector<std::int8_t> q(4, 9);
  std::vector<std::uint8_t> q8(4, 9);
  const std::vector<double> zeros = {0.0, -0.0, 0.0, 0.0};
  EXPECT_EQ(detail::quantize_int8_row(zeros.data(), 4, q.data()), 0.0f);
  EXPECT_EQ(q, std::vector<std::int8_t>(4, 0));
  EXPECT_EQ(detail::quantize_e4m3_row(zeros.data(), 4, q8.data()), 0.0f);
  EXPECT_EQ(q8, std::vector<std::uint8_t>(4, 0));

  const std::vector<float> huge = {std::numeric_limits<float>::max(), 1.0f, -2e36f, 0.0f};
  const float s = detail::quantize_int8_row(huge.data(), 4, q.data());
  EXPECT_EQ(q, (std::vector<std::int8_t>{127, 0, -1, 0}));
  EXPECT_TRUE(std::isfinite(detail::dequantize_int8(127, s)));
  const float s8 = detail::quantize_e4m3_row(huge.data(), 4, q8.data());
  EXPECT_EQ(q8[0], 0x7E);
  EXPECT_TRUE(std::isfinite(detail::dequantize_e4m3(q8[0], s8)));
  EXPECT_EQ(detail::e4m3_to_float(q8[1]), 0.0f);

  const double inf = std::numeric_limits<double>::infinity();
  for (const std::vector<double>& bad :
       {std::vector<double>{1, kNaN, 2, 3}, {inf, 1, 2, 3}, {1, 2, 3, -inf}, {1, 1e39, 2, 3} /* beyond float32 */}) {
    EXPECT_TRUE(std::isnan(detail::quantize_int8_row(bad.data(), 4, q.data())));
    EXPECT_EQ(q, std::vector<std::int8_t>(4, 0));
    const float nan_scale = detail::quantize_e4m3_row(bad.data(), 4, q8.data());
    EXPECT_TRUE(std::isnan(nan_scale));
    EXPECT_EQ(q8, std::vector<std::uint8_t>(4, 0));
    for (std::int8_t v : q) EXPECT_TRUE(std::isnan(detail::dequantize_int8(v, nan_scale)));  // all read back NaN
  }
  // A strided row (every third element) and a bfloat16 row quantize as their values do.
  const std::vector<double> strided = {1.5, 99, 99, -3.25, 99, 99, 0.125};
  const std::vector<double> packed = {1.5, -3.25, 0.125};
  const std::vector<mha::bfloat16> bf = {1.5f, -3.25f, 0.125f};
  std::vector<std::int8_t> a(3), b(3), c(3);
  EXPECT_EQ(detail::quantize_int8_row(strided.data(), 3, a.data(), 3),
            detail::quantize_int8_row(packed.data(), 3, b.data()));
  EXPECT_EQ(detail::quantize_int8_row(bf.data(), 3, c.data()), detail::quantize_int8_row(packed.data(), 3, b.data()));
  EXPECT_EQ(a, b);
  EXPECT_EQ(c, b);
}

TEST(QuantizedKVCache, PageLayoutPayloadsThenScalesAlignedAsDocumented) {
  const std::int64_t shapes[][4] = {{1, 1, 1, 1}, {3, 5, 3, 5}, {2, 16, 64, 64}, {1, 7, 3, 2}, {4, 256, 5, 9}};
  for (KVStorage storage : {KVStorage::Int8, KVStorage::Float8E4M3})
    for (const auto& [h, P, d_k, d_v] : shapes) {
      const PagedKVCache cache(quantized(storage, h, P, d_k, d_v, 3 * P));
      ASSERT_EQ(cache.page_count(), 3);
      const std::int64_t scales_at = aligned(h * P * (d_k + d_v), 4), stride = aligned(scales_at + 8 * h * P, 64);
      for (std::int32_t page = 0; page < 3; ++page) {
        const auto* k = static_cast<const std::byte*>(cache.key_page(page));
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(k) % 64, 0u) << h << " " << P;
        EXPECT_EQ(static_cast<const std::byte*>(cache.value_page(page)) - k, h * P * d_k);
        ASSERT_NE(cache.key_scales(page), nullptr);
        EXPECT_EQ(reinterpret_cast<const std::byte*>(cache.key_scales(page)) - k, scales_at);
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(cache.key_scales(page)) % 4, 0u);
        EXPECT_EQ(cache.value_scales(page) - cache.key_scales(page), h * P);
        if (page > 0) {
          EXPECT_EQ(k - static_cast<const std::byte*>(cache.key_page(page - 1)), stride) << h << " " << P;
        }
      }
      EXPECT_THROW(cache.key_scales(3), mha::Error);
      EXPECT_THROW(cache.value_scales(-1), mha::Error);
    }
  const PagedKVCache native({.num_kv_heads = 2, .head_dim = 3, .page_size = 4, .capacity_tokens = 8});
  EXPECT_EQ(native.key_scales(0), nullptr);
  EXPECT_EQ(native.value_scales(1), nullptr);
  EXPECT_EQ(static_cast<const std::byte*>(native.key_page(1)) - static_cast<const std::byte*>(native.key_page(0)),
            2 * 4 * 6 * 4);  // native pages back to back, as before
}

// What `cache` holds at position t of sequence s, head j, against the quantizer run on `row` [d] here:
// the payload bytes and the scale where the layout says, and keys() / values() reading them back.
::testing::AssertionResult holds_row(const PagedKVCache& cache, PagedKVCache::SequenceId s, bool values, std::int64_t t,
                                     std::int64_t j, const float* row) {
  const auto& c = cache.config();
  const std::int64_t d = values ? c.value_dim : c.head_dim, P = c.page_size;
  const std::int32_t page = cache.page_table(s)[static_cast<std::size_t>(t / P)];
  const auto* payload =
      static_cast<const std::uint8_t*>(values ? cache.value_page(page) : cache.key_page(page)) + (j * P + t % P) * d;
  const float* scales = values ? cache.value_scales(page) : cache.key_scales(page);  // [h_kv, P]
  const float scale = scales[j * P + t % P];
  std::vector<std::uint8_t> expected(static_cast<std::size_t>(d));
  const float expected_scale = c.storage == KVStorage::Int8
                                   ? detail::quantize_int8_row(row, d, reinterpret_cast<std::int8_t*>(expected.data()))
                                   : detail::quantize_e4m3_row(row, d, expected.data());
  if (std::memcmp(&scale, &expected_scale, 4) != 0 || std::memcmp(payload, expected.data(), expected.size()) != 0)
    return ::testing::AssertionFailure() << "payload or scale differ at position " << t << " head " << j;
  const Tensor back = values ? cache.values(s) : cache.keys(s);
  for (std::int64_t i = 0; i < d; ++i) {
    const float x = c.storage == KVStorage::Int8 ? detail::dequantize_int8(static_cast<std::int8_t>(payload[i]), scale)
                                                 : detail::dequantize_e4m3(payload[i], scale);
    const float got = back.data_as<float>()[(j * cache.length(s) + t) * d + i];
    if (std::memcmp(&got, &x, 4) != 0) return ::testing::AssertionFailure() << "read back differs at " << t << " " << i;
  }
  return ::testing::AssertionSuccess();
}

TEST(QuantizedKVCache, AppendQuantizesEachRowIntoItsPlaceAndCopyOnWriteKeepsBoth) {
  constexpr std::int64_t h = 2, P = 3, d_k = 4, d_v = 5;
  for (KVStorage storage : {KVStorage::Int8, KVStorage::Float8E4M3}) {
    PagedKVCache cache(quantized(storage, h, P, d_k, d_v, 30));
    std::mt19937 gen(4);
    std::normal_distribution<float> normal;
    // keys [n, h, d_k] viewed transposed over a [d_k, h, n] buffer; values contiguous
    auto append = [&](PagedKVCache::SequenceId s, std::int64_t n, std::vector<float>& k, std::vector<float>& v) {
      k.resize(static_cast<std::size_t>(n * h * d_k)), v.resize(static_cast<std::size_t>(n * h * d_v));
      for (float& x : k) x = normal(gen);
      for (float& x : v) x = normal(gen) * 1e-40f;  // subnormal values
      cache.append(s, TensorView(std::span<const float>(k), {n, h, d_k}, {1, n, h * n}),
                   TensorView(std::span<const float>(v), {n, h, d_v}));
    };
    std::vector<float> k0, v0, k1, v1, k2, v2;
    const auto parent = cache.add_sequence();
    append(parent, 4, k0, v0);  // a page and one row: the fork shares a partly filled page
    const auto child = cache.fork(parent);
    append(child, 3, k1, v1);
    append(parent, 1, k2, v2);
    auto key_row = [&](const std::vector<float>& k, std::int64_t n, std::int64_t t, std::int64_t j) {
      std::vector<float> row(d_k);
      for (std::int64_t i = 0; i < d_k; ++i) row[i] = k[static_cast<std::size_t>(t + j * n + i * h * n)];
      return row;
    };
    for (std::int64_t j = 0; j < h; ++j) {
      for (std::int64_t t = 0; t < 4; ++t)
        for (auto s : {parent, child}) {
          EXPECT_TRUE(holds_row(cache, s, false, t, j, key_row(k0, 4, t, j).data()));
          EXPECT_TRUE(holds_row(cache, s, true, t, j, v0.data() + (t * h + j) * d_v));
        }
      for (std::int64_t t = 0; t < 3; ++t) {
        EXPECT_TRUE(holds_row(cache, child, false, 4 + t, j, key_row(k1, 3, t, j).data()));
        EXPECT_TRUE(holds_row(cache, child, true, 4 + t, j, v1.data() + (t * h + j) * d_v));
      }
      EXPECT_TRUE(holds_row(cache, parent, false, 4, j, key_row(k2, 1, 0, j).data()));
      EXPECT_TRUE(holds_row(cache, parent, true, 4, j, v2.data() + j * d_v));
    }
    EXPECT_EQ(cache.page_table(parent)[0], cache.page_table(child)[0]);  // the full page still shared
    EXPECT_NE(cache.page_table(parent)[1], cache.page_table(child)[1]);  // the partly filled one copied
  }
}

TEST(QuantizedKVCache, RefusesOtherDtypesAndStoragesByNameAndLeavesTheCacheUnchanged) {
  for (DType dtype : {DType::Float64, DType::BFloat16, DType::Bool}) {
    auto config = quantized(KVStorage::Float8E4M3, 1, 4, 2, 2, 8);
    config.dtype = dtype;
    const std::string message = message_of([&] { PagedKVCache cache(config); });
    EXPECT_EQ(message, std::string("PagedKVCache: storage: int8 and float8_e4m3 caches hold float32 keys and values "
                                   "quantized; dtype must be float32, got ") +
                           mha::dtype_name(dtype));
  }
  auto odd = quantized(KVStorage::Int8, 1, 4, 2, 2, 8);
  odd.storage = static_cast<KVStorage>(7);
  EXPECT_NE(message_of([&] { PagedKVCache cache(odd); }).find("storage: expected Native, Int8 or Float8E4M3"),
            std::string::npos);
  EXPECT_STREQ(mha::kv_storage_name(KVStorage::Float8E4M3), "float8_e4m3");
  EXPECT_STREQ(mha::kv_storage_name(KVStorage::Int8), "int8");

  PagedKVCache cache(quantized(KVStorage::Int8, 1, 4, 2, 2, 8));
  const auto s = cache.add_sequence();
  const std::vector<float> ok(4, 1.0f);
  const bool flags[4] = {true, false, true, false};
  const TensorView bools(std::span<const bool>(flags), {2, 1, 2}), floats(std::span<const float>(ok), {2, 1, 2});
  EXPECT_NE(message_of([&] {
              cache.append(s, bools, floats);
            }).find("keys: expected float32, float64 or bfloat16 (the cache is quantized, int8), got bool"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              cache.append(s, floats, TensorView(std::span<const float>(ok), {2, 1, 1}));
            }).find("values: expected [n, num_kv_heads, value_dim]"),
            std::string::npos);
  EXPECT_EQ(cache.length(s), 0);
  EXPECT_EQ(cache.free_pages(), 2);
  const std::vector<double> k64 = {1, 2, 3, 4};
  cache.append(s, TensorView(std::span<const double>(k64), {2, 1, 2}), floats);  // float64 keys, float32 values
  EXPECT_EQ(cache.length(s), 2);
}

}  // namespace
