// Helpers shared by the C++ tests: a seeded RNG, element access for any dtype and any strides,
// tensor construction from plain values, and comparisons that say where they fail.
//
// Nothing here calls into the library except Tensor's constructor and accessors, so the helpers can
// serve as an independent check of what the library computes.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "mha/mha.hpp"

// gtest prints parameters through PrintTo found by argument-dependent lookup, so the kernel's goes in
// the library's namespace (test code only).
namespace mha {
inline void PrintTo(Kernel kernel, std::ostream* os) {
  *os << (kernel == Kernel::Reference ? "Kernel::Reference" : kernel == Kernel::Flash ? "Kernel::Flash" : "Kernel::?");
}
inline void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }
}  // namespace mha

namespace mha_test {

using mha::DType;
using mha::Shape;
using mha::Tensor;
using mha::TensorView;

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// True in the ASan + UBSan build (`make test-asan`, Debug): tests there use smaller sizes.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderSanitizers = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
inline constexpr bool kUnderSanitizers = true;
#else
inline constexpr bool kUnderSanitizers = false;
#endif
#else
inline constexpr bool kUnderSanitizers = false;
#endif
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A seeded generator; every test that draws numbers owns one, so tests are reproducible.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : gen_(seed) {}
  double uniform(double lo = -1.0, double hi = 1.0) { return std::uniform_real_distribution<double>(lo, hi)(gen_); }
  bool bernoulli(double p) { return uniform(0.0, 1.0) < p; }
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {  // inclusive
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen_);
  }

 private:
  std::mt19937_64 gen_;
};

// Element `offset` (in elements) of memory of type `dtype`, as a double (bool: 0 or 1).
inline double load(const void* base, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::Float32: return static_cast<const float*>(base)[offset];
    case DType::Float64: return static_cast<const double*>(base)[offset];
    case DType::Bool: return static_cast<const std::uint8_t*>(base)[offset] != 0 ? 1.0 : 0.0;
    case DType::BFloat16: return static_cast<const mha::bfloat16*>(base)[offset];
  }
  return kNaN;
}

inline void store(void* base, DType dtype, std::int64_t offset, double value) {
  switch (dtype) {
    case DType::Float32: static_cast<float*>(base)[offset] = static_cast<float>(value); break;
    case DType::Float64: static_cast<double*>(base)[offset] = value; break;
    case DType::Bool: static_cast<std::uint8_t*>(base)[offset] = value != 0.0 ? 1 : 0; break;
    case DType::BFloat16: static_cast<mha::bfloat16*>(base)[offset] = static_cast<float>(value); break;
  }
}

// The elements of any (strided, broadcast) view in C order, read through its strides.
inline std::vector<double> to_doubles(const TensorView& view) {
  const std::int64_t n = view.numel();
  std::vector<double> out;
  if (n <= 0) return out;
  out.reserve(static_cast<std::size_t>(n));
  const std::int64_t rank = view.rank();
  std::vector<std::int64_t> index(static_cast<std::size_t>(rank), 0);
  for (std::int64_t flat = 0; flat < n; ++flat) {
    std::int64_t offset = 0;
    for (std::int64_t d = 0; d < rank; ++d) offset += index[static_cast<std::size_t>(d)] * view.stride(d);
    out.push_back(load(view.data(), view.dtype(), offset));
    for (std::int64_t d = rank - 1; d >= 0; --d) {
      if (++index[static_cast<std::size_t>(d)] < view.size(d)) break;
      index[static_cast<std::size_t>(d)] = 0;
    }
  }
  return out;
}

// A tensor of `dtype` and `shape` holding `values` (C order), converted element by element.
inline Tensor make_tensor(DType dtype, const Shape& shape, const std::vector<double>& values) {
  Tensor t(dtype, shape);
  EXPECT_EQ(static_cast<std::int64_t>(values.size()), t.numel()) << "make_tensor: value count";
  for (std::size_t i = 0; i < values.size() && static_cast<std::int64_t>(i) < t.numel(); ++i)
    store(t.data(), dtype, static_cast<std::int64_t>(i), values[i]);
  return t;
}

inline std::vector<double> random_values(std::int64_t n, Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

inline Tensor random_tensor(DType dtype, const Shape& shape, Rng& rng, double lo = -1.0, double hi = 1.0) {
  return make_tensor(dtype, shape, random_values(mha::shape_numel(shape), rng, lo, hi));
}

// Rounds each value to what `dtype` stores (float32: nearest float), so an fp64 oracle can be fed
// exactly the numbers the library sees.
// x rounded to bfloat16 (once, to nearest even; tests/cpp/tensor/bfloat16_test.cpp checks that rounding
// against an independent search), as a double.
inline double bf16_rounded(double x) { return static_cast<float>(mha::bfloat16::from_double(x)); }

inline std::vector<double> rounded_to(DType dtype, std::vector<double> values) {
  if (dtype == DType::Float32)
    for (auto& x : values) x = static_cast<double>(static_cast<float>(x));
  if (dtype == DType::BFloat16)
    for (auto& x : values) x = bf16_rounded(x);
  return values;
}

// Same dtype, shape and bytes (NaNs compare by bit pattern).
inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "dtype " << mha::dtype_name(a.dtype()) << " vs "
                                         << mha::dtype_name(b.dtype());
  if (a.shape() != b.shape())
    return ::testing::AssertionFailure() << "shape " << mha::shape_str(a.shape()) << " vs "
                                         << mha::shape_str(b.shape());
  if (a.nbytes() == 0) return ::testing::AssertionSuccess();
  const auto* pa = static_cast<const unsigned char*>(a.data());
  const auto* pb = static_cast<const unsigned char*>(b.data());
  const std::size_t elem = mha::dtype_size(a.dtype());
  for (std::size_t i = 0; i < a.nbytes(); i += elem) {
    if (std::memcmp(pa + i, pb + i, elem) != 0) {
      const auto e = static_cast<std::int64_t>(i / elem);
      return ::testing::AssertionFailure() << "first differing element " << e << ": " << load(a.data(), a.dtype(), e)
                                           << " vs " << load(b.data(), b.dtype(), e);
    }
  }
  return ::testing::AssertionSuccess();
}

// C-order multi-index of `flat` in `shape`, as "[i, j, k]".
inline std::string index_str(const Shape& shape, std::int64_t flat) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const std::int64_t n = shape[d] > 0 ? shape[d] : 1;
    idx[d] = flat % n;
    flat /= n;
  }
  std::ostringstream s;
  s << "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s << (d ? ", " : "") << idx[d];
  s << "]";
  return s.str();
}

// |actual - expected| <= atol + rtol * |expected| everywhere; infinities must match exactly and a
// NaN passes only where NaN is expected. Reports the count, the worst and the first few mismatches.
inline ::testing::AssertionResult all_close(const std::vector<double>& actual, const std::vector<double>& expected,
                                            double atol, double rtol, const Shape& shape = {}) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << "size " << actual.size() << " vs expected " << expected.size();
  std::ostringstream msg;
  std::size_t bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    bool ok;
    if (std::isnan(e)) ok = std::isnan(a);
    else if (std::isinf(e)) ok = a == e;
    else ok = std::isfinite(a) && std::fabs(a - e) <= atol + rtol * std::fabs(e);
    if (!ok) {
      if (bad < 5) {
        msg << "\n  at " << (shape.empty() ? std::to_string(i) : index_str(shape, static_cast<std::int64_t>(i)))
            << ": got " << a << ", expected " << e;
      }
      ++bad;
      if (std::isfinite(a) && std::isfinite(e)) worst = std::max(worst, std::fabs(a - e));
      else worst = kInf;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << actual.size() << " elements differ (atol " << atol
                                       << ", rtol " << rtol << ", worst abs error " << worst << ")" << msg.str();
}

inline ::testing::AssertionResult all_finite(const std::vector<double>& values) {
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i])) return ::testing::AssertionFailure() << "element " << i << " is " << values[i];
  return ::testing::AssertionSuccess();
}

// Tolerances against the fp64 oracle, by input dtype: float64 inputs are checked to near machine
// precision; float32 inputs to what one float32 rounding per operation allows.
struct Tolerance {
  double atol;
  double rtol;
};
inline Tolerance tolerance_for(DType dtype) {
  return dtype == DType::Float64 ? Tolerance{1e-12, 1e-12} : Tolerance{1e-5, 1e-5};
}

inline const char* short_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "f32";
    case DType::Float64: return "f64";
    case DType::Bool: return "bool";
    case DType::BFloat16: return "bf16";
  }
  return "?";
}

// Every attention kernel the library offers; the attention tests run each case on each of them.
inline constexpr mha::Kernel kAllKernels[] = {mha::Kernel::Reference, mha::Kernel::Flash};

inline const char* kernel_name(mha::Kernel kernel) {
  switch (kernel) {
    case mha::Kernel::Reference: return "reference";
    case mha::Kernel::Flash: return "flash";
  }
  return "unknown_kernel";
}

// A parametrized test over (P, kernel); options() starts AttentionOptions with the kernel set.
template <class P>
class KernelParamTest : public ::testing::TestWithParam<std::tuple<P, mha::Kernel>> {
 protected:
  const P& param() const { return std::get<0>(this->GetParam()); }
  mha::Kernel kernel() const { return std::get<1>(this->GetParam()); }
  mha::AttentionOptions options() const {
    mha::AttentionOptions o;
    o.kernel = kernel();
    return o;
  }
};

// The parameters of a KernelParamTest<DType> over both floating dtypes and every kernel, and their
// test names ("f64_reference", ...):
//   INSTANTIATE_TEST_SUITE_P(Dtypes, Suite, kFloatDtypesTimesKernels, dtype_kernel_name);
inline const auto kFloatDtypesTimesKernels =
    ::testing::Combine(::testing::Values(DType::Float64, DType::Float32), ::testing::ValuesIn(kAllKernels));

inline std::string dtype_kernel_name(const ::testing::TestParamInfo<std::tuple<DType, mha::Kernel>>& info) {
  return std::string(short_name(std::get<0>(info.param))) + "_" + kernel_name(std::get<1>(info.param));
}

// Whether f() throws mha::Error with `fragment` in its message (any other outcome is a failure that says
// what happened instead).
template <class F>
::testing::AssertionResult throws_error_containing(F&& f, const std::string& fragment) {
  try {
    f();
  } catch (const mha::Error& e) {
    if (std::string(e.what()).find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "mha::Error without \"" << fragment << "\": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "not an mha::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "nothing thrown (expected \"" << fragment << "\")";
}

// Restores the library's thread count when a test ends, whatever it set.
class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(mha::num_threads()) {}
  ~ThreadCountGuard() { mha::set_num_threads(saved_); }
  ThreadCountGuard(const ThreadCountGuard&) = delete;
  ThreadCountGuard& operator=(const ThreadCountGuard&) = delete;

 private:
  int saved_;
};

}  // namespace mha_test
