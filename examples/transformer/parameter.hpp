// Parameter<T>: a named trainable array with its gradient, and the generator that initialises them.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "splitmix64.hpp"

namespace transformer {

template <class T>
struct Parameter {
  std::string name;                 // e.g. "encoder.0.ffn.linear1.weight"
  std::vector<std::int64_t> shape;  // e.g. [d_ff, d_model]
  std::vector<T> value;             // row-major
  std::vector<T> grad;              // same shape; backward() adds to it, the optimizer zeroes it

  Parameter() = default;
  Parameter(std::string n, std::vector<std::int64_t> s) : name(std::move(n)), shape(std::move(s)) {
    std::int64_t count = 1;
    for (auto d : shape) count *= d;
    value.assign(static_cast<std::size_t>(count), T(0));
    grad.assign(static_cast<std::size_t>(count), T(0));
  }
  std::int64_t numel() const { return static_cast<std::int64_t>(value.size()); }
};

template <class T>
using ParameterRefs = std::vector<Parameter<T>*>;

// Seeded numbers from the library's SplitMix64 (src/splitmix64.hpp): the same numbers on every
// platform, unlike std:: distributions.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : generator_(seed) {}
  std::uint64_t next() { return generator_.next(); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  double normal() {  // Box-Muller
    const double u = 1.0 - uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }

 private:
  mha::detail::SplitMix64 generator_;
};

// Xavier/Glorot uniform for a [fan_out, fan_in] weight: U(-a, a), a = sqrt(6 / (fan_in + fan_out)).
template <class T>
void xavier_uniform(Parameter<T>& p, Rng& rng) {
  const double bound = std::sqrt(6.0 / static_cast<double>(p.shape.at(0) + p.shape.at(1)));
  for (auto& v : p.value) v = static_cast<T>(rng.uniform(-bound, bound));
}

}  // namespace transformer
