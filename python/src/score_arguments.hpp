// The score's description (mha/score.hpp) from Python's arguments: converted once, here, for every
// binding that attends (scaled_dot_product_attention and its backward, the layer's forward and
// forward_cached). A new part of the score is one argument here and one field of ScoreSpec.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "bindings.hpp"
#include "mha/score.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

// The score's arguments as a binding receives them: attn_mask, key_padding_mask [B, S] and
// alibi_slopes [h] and sinks [h] array-likes or None; scale a number or None; window (left, right) or None; softcap a
// number, or None or 0 for none.
struct ScoreArguments {
  py::handle attn_mask;
  bool is_causal = false;
  py::handle scale;
  py::handle key_padding_mask;
  std::vector<std::int64_t> key_lengths;
  py::handle window;
  py::handle alibi_slopes;
  py::handle softcap;
  py::handle sinks{};
};

// A ScoreSpec and the arrays its views point into (kept alive as long as it is used).
struct HeldScore {
  ScoreSpec score;
  std::optional<ArrayView> attn_mask, key_padding_mask, alibi_slopes, sinks;
};

// Converts and checks the types (mha.Error naming the argument); the library checks the values.
HeldScore score_of(ScoreArguments arguments);

}  // namespace mha::python
