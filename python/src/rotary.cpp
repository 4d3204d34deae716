// Binds apply_rotary and its backward (mha/rotary.hpp) as mha.apply_rotary / mha.apply_rotary_backward: x
// viewed in place (any strides), positions as an int64 or int32 array, the compute without the GIL.
//
// Legend: B batch, h heads, L positions, d head width, r rotary_dim.
#include "mha/rotary.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "arguments.hpp"
#include "bindings.hpp"
#include "mha/error.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

namespace {

// base, rotary_dim and interleaved as RotaryOptions: rotary_dim None is the whole head (0 in C++); an
// explicit 0 is refused rather than read as "the whole head".
RotaryOptions rotary_options(py::handle base, py::handle rotary_dim, py::handle interleaved) {
  RotaryOptions options;
  options.base = float_arg(base, "base");
  if (!rotary_dim.is_none()) {
    options.rotary_dim = int64_arg(rotary_dim, "rotary_dim");
    if (options.rotary_dim == 0)
      throw Error("rotary_dim: expected None (the whole head) or an even number of components in [2, d], got 0");
  }
  options.interleaved = flag_arg(interleaved, "interleaved");
  return options;
}

// x: [B, h, L, d] named `name`. Returns y = R x (inverse: R^T x), [B, h, L, d]: float32 for float32 and
// float32-converted bfloat16 input, float64 for float64, a BFloat16Bits when x is one.
py::object rotary(py::handle x, const char* name, py::handle positions, py::handle base, py::handle rotary_dim,
                  py::handle interleaved, bool inverse) {
  const ArrayView x_view = view_of(x, name, Accept::Float);
  const HeldPositions held = positions_arg(positions, "positions");
  const RotaryOptions options = rotary_options(base, rotary_dim, interleaved);
  Tensor y;
  {
    py::gil_scoped_release release;
    y = inverse ? apply_rotary_backward(x_view.view, held.view, options)
                : apply_rotary(x_view.view, held.view, options);
  }
  return to_python(std::move(y), bfloat16_out_like(x));
}

constexpr const char* kApplyRotaryDoc =
    "Rotary position embeddings (RoPE, Su et al. 2021): y = R(positions) x. x: [B, h, L, d], float32,\n"
    "float64 or bfloat16 (BFloat16Bits), any strides. For each row and each pair i < r/2 (r = rotary_dim):\n"
    "    theta = position * base**(-2i / r)\n"
    "    y[a] = x[a] cos(theta) - x[b] sin(theta),   y[b] = x[b] cos(theta) + x[a] sin(theta)\n"
    "with (a, b) = (i, i + r/2) (GPT-NeoX, Llama) or (2i, 2i + 1) when interleaved (GPT-J); components\n"
    "from r on pass unchanged. The angle and its cos and sin are computed in float64 (positions of 1e5-1e6\n"
    "stay exact), then used in float32 (float32, bfloat16: rounded to bfloat16 once) or float64.\n"
    "positions: None for 0..L-1, or int64 / int32 [L] (every batch row) or [B, L] (per row), values >= 0.\n"
    "rotary_dim: None for d (even), or an even number in [2, d]. base: finite, > 0.\n"
    "Returns a new array of x's dtype and shape. Raises mha.Error naming the argument on bad input.";

constexpr const char* kApplyRotaryBackwardDoc =
    "The backward of apply_rotary: dx = R(positions)^T dy, each pair rotated by -theta (a rotation's\n"
    "transpose is its inverse), with the forward's positions, base, rotary_dim and interleaved.\n"
    "dy: [B, h, L, d]; returns dx as a new array of dy's dtype and shape (nothing accumulated).";

}  // namespace

void register_rotary(py::module_& m) {
  const RotaryOptions defaults;
  m.def(
      "apply_rotary",
      [](py::handle x, py::handle positions, py::handle base, py::handle rotary_dim, py::handle interleaved) {
        return rotary(x, "x", positions, base, rotary_dim, interleaved, false);
      },
      py::arg("x"), py::arg("positions") = py::none(), py::kw_only(), py::arg("base") = defaults.base,
      py::arg("rotary_dim") = py::none(), py::arg("interleaved") = false, kApplyRotaryDoc);
  m.def(
      "apply_rotary_backward",
      [](py::handle dy, py::handle positions, py::handle base, py::handle rotary_dim, py::handle interleaved) {
        return rotary(dy, "dy", positions, base, rotary_dim, interleaved, true);
      },
      py::arg("dy"), py::arg("positions") = py::none(), py::kw_only(), py::arg("base") = defaults.base,
      py::arg("rotary_dim") = py::none(), py::arg("interleaved") = false, kApplyRotaryBackwardDoc);
}

}  // namespace mha::python
