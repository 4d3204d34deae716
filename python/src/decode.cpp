// Binds decode_attention (mha/decode.hpp) as mha.decode_attention: q viewed in place (float32 / float64
// data for a bfloat16 cache rounded to bfloat16 first, as PagedKVCache.append rounds keys and values).
#include "mha/decode.hpp"

#include <optional>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "score_arguments.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {
namespace {

// q: [n, q_len, num_heads, head_dim]. Returns out [n, q_len, num_heads, value_dim], or (out, lse
// [n, q_len, num_heads]) with need_lse; bfloat16 results are float32 arrays, or BFloat16Bits when q is one.
py::object decode(py::handle q, py::handle cache_obj, py::handle sequence_ids, py::handle scale_arg,
                  py::handle need_lse_obj, bool is_causal, py::handle window, py::handle alibi_slopes,
                  py::handle softcap, py::handle sinks) {
  const PagedKVCache& cache = object_arg<PagedKVCache>(cache_obj, "cache", "an mha.PagedKVCache");
  const bool need_lse = flag_arg(need_lse_obj, "need_lse");
  ArrayView q_view = view_of(q, "q", Accept::Float);
  const std::vector<PagedKVCache::SequenceId> sequences = int64_sequence_arg(sequence_ids, "sequences");
  const HeldScore score = score_of({{}, is_causal, scale_arg, {}, {}, window, alibi_slopes, softcap, sinks});
  DecodeOptions options;
  static_cast<ScoreSpec&>(options) = score.score;
  options.need_lse = need_lse;
  if (cache.config().dtype == DType::BFloat16) q_view = converted_to(std::move(q_view), DType::BFloat16);
  DecodeResult result;
  {
    py::gil_scoped_release release;  // the call holds the cache for reading (PagedKVCache's threads
                                     // contract): another thread's append, fork or release waits for it
    result = decode_attention(q_view.view, cache, sequences, options);
  }
  py::object out = to_python(std::move(result.out), bfloat16_out_like(q));
  if (!need_lse) return out;
  return py::make_tuple(out, to_numpy(std::move(result.lse)));
}

}  // namespace

void register_decode(py::module_& m) {
  m.def("decode_attention", &decode, py::arg("q"), py::arg("cache"), py::arg("sequences"), py::kw_only(),
        py::arg("scale") = py::none(), py::arg("need_lse") = false, py::arg("is_causal") = true,
        py::arg("window") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(),
        "Attention of each sequence's new queries over its cached keys and values, read through the page\n"
        "table. q: [n, q_len, num_heads, head_dim]; sequences: n ids of the cache (repeats allowed), each\n"
        "holding at least q_len positions, the last q_len being the new tokens themselves: query i sees\n"
        "positions <= length - q_len + i. num_heads must be a multiple of the cache's num_kv_heads (query\n"
        "head i reads kv head i // (num_heads // num_kv_heads)). scale: default 1 / sqrt(head_dim); else 0\n"
        "or a normal finite number of the logit dtype (float32 for float32 and bfloat16 caches, magnitude\n"
        "in [1.1754944e-38, 3.4028235e+38]; float64 for float64), else mha.Error naming scale. sequences:\n"
        "a sequence of int64 ids. is_causal=False lets every query see all its sequence's positions.\n"
        "window (left, right), alibi_slopes [h], softcap and sinks [h] as scaled_dot_product_attention\n"
        "takes them, over the sequence's positions (query i at length - q_len + i).\n"
        "Returns out [n, q_len, num_heads, value_dim] (with need_lse: (out, lse [n, q_len, num_heads])).\n"
        "q has the cache's dtype; for a bfloat16 cache float32 / float64 q is rounded to bfloat16 and\n"
        "the result is float32 (a BFloat16Bits q gives a BFloat16Bits result). Runs without the GIL,\n"
        "holding the cache for reading: writes to it from other threads wait until it returns.");
}

}  // namespace mha::python
