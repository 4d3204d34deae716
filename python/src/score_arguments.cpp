// score_of (score_arguments.hpp): Python's score arguments as one ScoreSpec.
#include "score_arguments.hpp"

#include <utility>

#include "arguments.hpp"

namespace mha::python {

HeldScore score_of(ScoreArguments a) {
  // An argument a binding does not take (the layer has no scale) stays a null handle: None.
  for (py::handle* h : {&a.attn_mask, &a.scale, &a.key_padding_mask, &a.window, &a.alibi_slopes, &a.softcap, &a.sinks})
    if (!*h) *h = py::none();
  HeldScore held;
  ScoreSpec& s = held.score;
  held.attn_mask = optional_view_of(a.attn_mask, "attn_mask", Accept::Mask);
  held.key_padding_mask = optional_view_of(a.key_padding_mask, "key_padding_mask", Accept::Mask);
  held.alibi_slopes = optional_view_of(a.alibi_slopes, "alibi_slopes", Accept::Float);
  if (held.attn_mask) s.attn_mask = held.attn_mask->view;
  if (held.key_padding_mask) s.key_padding_mask = held.key_padding_mask->view;
  held.sinks = optional_view_of(a.sinks, "sinks", Accept::Float);
  if (held.alibi_slopes) s.alibi_slopes = held.alibi_slopes->view;
  if (held.sinks) s.sinks = held.sinks->view;
  s.scale = optional_float_arg(a.scale, "scale");
  s.causal = a.is_causal;
  s.key_lengths = std::move(a.key_lengths);
  if (const auto window = window_arg(a.window)) s.window_left = window->first, s.window_right = window->second;
  s.softcap = softcap_arg(a.softcap);
  return held;
}

}  // namespace mha::python
