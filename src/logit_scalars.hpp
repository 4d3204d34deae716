// The numbers a logit is formed with (scale, softcap, ALiBi slopes, sinks), how they are read, and the
// range the public boundary accepts them in. They arrive as double (slopes as float32 or float64) and the kernels
// compute with them in the logit dtype: float32 for float32 and bfloat16 inputs, float64 for float64. A value that is
// not 0 or a normal finite number of that dtype does not survive the conversion: 1e39 becomes inf in float32, so every
// output is NaN where the float64 result is finite, and 5e-324 becomes 0 (for softcap, "none": the cap silently
// dropped). Such values are refused, naming the argument and this range.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "mha/tensor.hpp"

namespace mha::detail {

// Per-head numbers (ALiBi slopes, sinks): element `head` of a float32 or float64 [h] view of any stride.
inline double per_head_value(const TensorView& values, std::int64_t head) {
  const std::int64_t at = head * values.stride(0);
  return values.dtype() == DType::Float32 ? values.data_as<float>()[at] : values.data_as<double>()[at];
}

// All of them, converted to A (the kernel's compute type); empty when there are none.
template <class A>
std::vector<A> per_head_values(const std::optional<TensorView>& values) {
  std::vector<A> out;
  for (std::int64_t head = 0; values && head < values->size(0); ++head)
    out.push_back(static_cast<A>(per_head_value(*values, head)));
  return out;
}

// The dtype logits are computed in for inputs of `inputs`: float32 for float32 and bfloat16.
inline DType logit_dtype(DType inputs) { return inputs == DType::Float64 ? DType::Float64 : DType::Float32; }

// Whether `value` is 0 or a normal finite number of the logit dtype of `inputs` (NaN is not).
inline bool zero_or_normal(double value, DType inputs) {
  const bool f64 = logit_dtype(inputs) == DType::Float64;
  const double smallest = f64 ? std::numeric_limits<double>::min() : std::numeric_limits<float>::min();
  const double largest = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  const double magnitude = std::fabs(value);
  return magnitude == 0.0 || (magnitude >= smallest && magnitude <= largest);
}

// The shortest text that reads back as `value` ("1e+39", "5e-324", "nan").
template <class T>
std::string number_str(T value) {
  char buffer[32];
  const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, value);
  return ec == std::errc() ? std::string(buffer, end) : std::to_string(value);
}

// "[1.1754944e-38, 3.4028235e+38] (normal float32 numbers: float32 inputs compute their logits in
// float32)": the magnitudes zero_or_normal accepts besides 0, for error messages.
inline std::string normal_range(DType inputs) {
  const bool f64 = logit_dtype(inputs) == DType::Float64;
  const std::string logit = f64 ? "float64" : "float32";
  std::string range = "[";
  range += f64 ? number_str(std::numeric_limits<double>::min()) : number_str(std::numeric_limits<float>::min());
  range += ", ";
  range += f64 ? number_str(std::numeric_limits<double>::max()) : number_str(std::numeric_limits<float>::max());
  range += "] (normal " + logit + " numbers: ";
  range += dtype_name(inputs);
  range += " inputs compute their logits in " + logit + ")";
  return range;
}

}  // namespace mha::detail
