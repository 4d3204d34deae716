// Attention sinks: the boundary's check and the gradient (see sinks.hpp for the formulas).
#include "attention/sinks.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "logit_scalars.hpp"
#include "mha/bfloat16.hpp"
#include "mha/error.hpp"

namespace mha::detail {

namespace {

// Element `offset` (in elements) of a floating tensor's data, as a double.
double element(const TensorView& t, std::int64_t offset) {
  switch (t.dtype()) {
    case DType::Float32: return t.data_as<float>()[offset];
    case DType::Float64: return t.data_as<double>()[offset];
    case DType::BFloat16: return static_cast<float>(t.data_as<bfloat16>()[offset]);
    default: throw Error("internal: element of a non-floating tensor");
  }
}

}  // namespace

void validate_sinks(const TensorView& sinks, DType inputs, std::int64_t h) {
  if (sinks.dtype() != DType::Float32 && sinks.dtype() != DType::Float64)
    throw Error("sinks: expected float32 or float64 [h], got " + std::string(dtype_name(sinks.dtype())) + " " +
                shape_str(sinks.shape()));
  if (sinks.shape() != Shape{h})
    throw Error("sinks: expected one logit per query head, [h] = " + shape_str({h}) + ", got " +
                shape_str(sinks.shape()));
  const bool f64 = logit_dtype(inputs) == DType::Float64;
  const double largest = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  const std::string largest_str =
      f64 ? number_str(std::numeric_limits<double>::max()) : number_str(std::numeric_limits<float>::max());
  for (std::int64_t head = 0; head < h; ++head) {
    const double sink = element(sinks, head * sinks.stride(0));
    if (std::isfinite(sink) && std::fabs(sink) > largest)
      throw Error("sinks: expected finite values within +-" + largest_str + " (" + dtype_name(logit_dtype(inputs)) +
                  ", the dtype " + dtype_name(inputs) + " inputs compute their logits in), got " + number_str(sink) +
                  " for head " + std::to_string(head));
  }
}

void accumulate_sink_gradient(const TensorView& dout, const TensorView& out, const TensorView& lse,
                              const TensorView& sinks, std::vector<double>& dsinks) {
  const std::int64_t B = out.size(0), h = out.size(1), L = out.size(2), d_v = out.size(3);
#pragma omp parallel for schedule(static) if (B * L * d_v * h > (1 << 16))
  for (std::int64_t head = 0; head < h; ++head) {
    const double sink = element(sinks, head * sinks.stride(0));
    double sum = 0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < L; ++i) {
        double D = 0;  // dout_i . out_i over the row's nonzero outputs
        bool depends = false;
        for (std::int64_t e = 0; e < d_v; ++e) {
          const double o =
              element(out, b * out.stride(0) + head * out.stride(1) + i * out.stride(2) + e * out.stride(3));
          if (o == 0.0) continue;
          depends = true;
          D += o * element(dout, b * dout.stride(0) + head * dout.stride(1) + i * dout.stride(2) + e * dout.stride(3));
        }
        if (!depends) continue;
        const double row_lse = element(lse, b * lse.stride(0) + head * lse.stride(1) + i * lse.stride(2));
        sum -= std::exp(sink - row_lse) * D;  // -p_sink D
      }
    dsinks[static_cast<std::size_t>(head)] += sum;
  }
}

Tensor sink_gradient_tensor(const std::vector<double>& dsinks, DType dtype) {
  const auto h = static_cast<std::int64_t>(dsinks.size());
  Tensor grad = Tensor::uninitialized(dtype, {h});
  for (std::int64_t head = 0; head < h; ++head) {
    const double g = dsinks[static_cast<std::size_t>(head)];
    if (dtype == DType::Float32) grad.data_as<float>()[head] = static_cast<float>(g);
    else grad.data_as<double>()[head] = g;
  }
  return grad;
}

}  // namespace mha::detail
