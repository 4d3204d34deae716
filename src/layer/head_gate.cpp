// The per-head gate: validation, and the gate's forward and backward (see head_gate.hpp).
//
// Legend: B batch, h heads, L queries, d_v the per-head value width.
#include "layer/head_gate.hpp"

#include <string>

#include "dtype_dispatch.hpp"
#include "mha/error.hpp"
#include "parallel.hpp"

namespace mha::detail {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

// The expected shapes, as messages name them.
std::string expected_shapes(std::int64_t h, bool batched, std::int64_t B) {
  if (!batched) return "[h] = [" + str(h) + "] (unbatched input)";
  return "[h] = [" + str(h) + "] or [B, h] = [" + str(B) + ", " + str(h) + "]";
}

// Element (b, i) of the gate as given ([h] or [B, h], any strides), converted to double.
double gate_element(const TensorView& gate, std::int64_t b, std::int64_t i) {
  const std::int64_t at = gate.rank() == 1 ? i * gate.stride(0) : b * gate.stride(0) + i * gate.stride(1);
  return gate.dtype() == DType::Float64 ? gate.data_as<double>()[at] : gate.data_as<float>()[at];
}

}  // namespace

HeadGate head_gate_of(const std::optional<TensorView>& gate, const MultiHeadAttentionConfig& c, bool batched,
                      std::int64_t B) {
  HeadGate g;
  if (!gate) return g;
  const std::int64_t h = c.num_heads;
  const TensorView& t = *gate;
  if (t.dtype() != DType::Float32 && t.dtype() != DType::Float64)
    fail(std::string("head_gate: expected float32 or float64, got ") + dtype_name(t.dtype()) + " " +
         shape_str(t.shape()));
  if (t.rank() != 1 && !(batched && t.rank() == 2))
    fail("head_gate: expected shape " + expected_shapes(h, batched, B) + ", got rank " + str(t.rank()) + " " +
         shape_str(t.shape()));
  if (t.shape().back() != h)
    fail("head_gate: expected one value per head (num_heads = " + str(h) + ") in its last dimension, got shape " +
         shape_str(t.shape()));
  if (t.rank() == 2 && t.size(0) != B)
    fail("head_gate: expected batch size " + str(B) + " like query in shape [B, h] = [" + str(B) + ", " + str(h) +
         "], got shape " + shape_str(t.shape()));
  g.given = true;
  g.shape = t.shape();
  g.dtype = t.dtype();
  g.values.resize(static_cast<std::size_t>(B * h));
  const bool float32_compute = c.dtype != DType::Float64;  // float32 and bfloat16 layers compute in float32
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < h; ++i) {
      const double value = gate_element(t, b, i);
      g.values[static_cast<std::size_t>(b * h + i)] = float32_compute ? static_cast<float>(value) : value;
    }
  return g;
}

template <class T>
void apply_head_gate(const HeadGate& gate, const TensorView& heads, T* gated) {
  using C = compute_t<T>;
  const std::int64_t B = heads.size(0), h = heads.size(1), L = heads.size(2), d_v = heads.size(3);
  const T* head = heads.data_as<T>();
  const SerialIfSmall serial_if_small(static_cast<double>(heads.numel()));
#pragma omp parallel for schedule(static)
  for (std::int64_t bh = 0; bh < B * h; ++bh) {
    const std::int64_t b = bh / h, i = bh % h;
    const C g = static_cast<C>(gate.values[static_cast<std::size_t>(bh)]);
    for (std::int64_t l = 0; l < L; ++l) {
      const std::int64_t row = b * heads.stride(0) + i * heads.stride(1) + l * heads.stride(2);
      for (std::int64_t c = 0; c < d_v; ++c) gated[row + c] = T(g * static_cast<C>(head[row + c]));
    }
  }
}

template <class T>
Tensor head_gate_backward(const HeadGate& gate, const TensorView& heads, T* d_gated) {
  using C = compute_t<T>;
  const std::int64_t B = heads.size(0), h = heads.size(1), L = heads.size(2), d_v = heads.size(3);
  const T* head = heads.data_as<T>();
  std::vector<double> dgate(static_cast<std::size_t>(B * h));  // [B, h]
  {
    const SerialIfSmall serial_if_small(2.0 * static_cast<double>(heads.numel()));
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < B * h; ++bh) {
      const std::int64_t b = bh / h, i = bh % h;
      const C g = static_cast<C>(gate.values[static_cast<std::size_t>(bh)]);
      double sum = 0;
      for (std::int64_t l = 0; l < L; ++l) {
        const std::int64_t row = b * heads.stride(0) + i * heads.stride(1) + l * heads.stride(2);
        for (std::int64_t c = 0; c < d_v; ++c) {
          // In the forward this was: gated = g * head.
          sum += static_cast<double>(static_cast<C>(d_gated[row + c])) * static_cast<double>(head[row + c]);
          d_gated[row + c] = T(g * static_cast<C>(d_gated[row + c]));
        }
      }
      dgate[static_cast<std::size_t>(bh)] = sum;
    }
  }
  Tensor grad(gate.dtype, gate.shape);  // [h] or [B, h]
  dispatch_float32_or_float64(gate.dtype, [&]<class G>(G) {
    G* out = grad.data_as<G>();
    if (gate.shape.size() == 2) {
      for (std::int64_t n = 0; n < B * h; ++n) out[n] = static_cast<G>(dgate[static_cast<std::size_t>(n)]);
      return;
    }
    for (std::int64_t i = 0; i < h; ++i) {  // a [h] gate: summed over the batches, in order
      double sum = 0;
      for (std::int64_t b = 0; b < B; ++b) sum += dgate[static_cast<std::size_t>(b * h + i)];
      out[i] = static_cast<G>(sum);
    }
  });
  return grad;
}

template void apply_head_gate<float>(const HeadGate&, const TensorView&, float*);
template void apply_head_gate<double>(const HeadGate&, const TensorView&, double*);
template void apply_head_gate<bfloat16>(const HeadGate&, const TensorView&, bfloat16*);
template Tensor head_gate_backward<float>(const HeadGate&, const TensorView&, float*);
template Tensor head_gate_backward<double>(const HeadGate&, const TensorView&, double*);
template Tensor head_gate_backward<bfloat16>(const HeadGate&, const TensorView&, bfloat16*);

}  // namespace mha::detail
