// `mha run`: load a layer from safetensors, inputs from .npy, write the output (and weights) as .npy.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads.
#include "commands/run.hpp"

#include <fmt/core.h>

#include <functional>
#include <optional>

#include "mha/attention.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"
#include "mha/multi_head_attention.hpp"

namespace mha_cli {

namespace {

// Runs `action`, prefixing any mha::Error with the flag and the file it concerns.
template <class F>
auto for_flag(const std::string& flag, const std::string& path, F action) -> decltype(action()) {
  try {
    return action();
  } catch (const mha::Error& e) {
    throw mha::Error(flag + " " + path + ": " + e.what());
  }
}

// The config of a layer whose file has no mha __metadata__: widths from the parameters' shapes.
//   q_proj_weight [h*d_k, E], k_proj_weight [h*d_k, kdim], v_proj_weight [h*d_v, vdim], or
//   in_proj_weight [3*h*d, E]; out_proj.weight [E, h*d_v].
mha::MultiHeadAttentionConfig config_from_shapes(const mha::SafetensorsFile& file, const RunOptions& o) {
  if (o.heads <= 0) throw mha::Error("--heads: the file has no mha metadata, so the number of heads is needed");
  if (o.layout.empty())  // PyTorch's default is seq-first, ours batch-first: no guess either way
    throw mha::Error(
        "--layout: the file has no mha metadata, so the inputs' layout is needed: --layout seq-first ([L, B, E], "
        "PyTorch's default) or --layout batch-first ([B, L, E])");
  auto shape = [&](const std::string& name) -> std::optional<mha::Shape> {
    auto it = file.tensors.find(name);
    if (it == file.tensors.end()) return std::nullopt;
    return it->second.shape();
  };
  const auto out_w = shape("out_proj.weight");
  if (!out_w || out_w->size() != 2) throw mha::Error("out_proj.weight: missing, or not a matrix");
  mha::MultiHeadAttentionConfig c;
  c.d_model = (*out_w)[0];
  c.num_heads = o.heads;
  if ((*out_w)[1] % o.heads != 0)
    throw mha::Error(fmt::format("--heads {}: does not divide out_proj.weight's width {}", o.heads, (*out_w)[1]));
  c.d_v = (*out_w)[1] / o.heads;
  if (const auto q_w = shape("q_proj_weight")) {
    const auto k_w = shape("k_proj_weight"), v_w = shape("v_proj_weight");
    if (!k_w || !v_w || q_w->size() != 2 || k_w->size() != 2 || v_w->size() != 2)
      throw mha::Error("q_proj_weight, k_proj_weight, v_proj_weight: expected all three, as matrices");
    c.d_k = (*q_w)[0] / o.heads;
    c.kdim = (*k_w)[1];
    c.vdim = (*v_w)[1];
  } else {
    c.d_k = c.d_v;  // packed in_proj_weight: d_k == d_v
  }
  c.bias = file.tensors.count("in_proj_bias") > 0;
  c.add_bias_kv = file.tensors.count("bias_k") > 0;
  c.add_zero_attn = o.add_zero_attn;
  c.batch_first = o.layout == "batch-first";
  return c;
}

// Flags that describe the layer must agree with a file whose metadata already does.
void check_flags_against_metadata(const mha::MultiHeadAttentionConfig& c, const RunOptions& o) {
  if (o.heads > 0 && o.heads != c.num_heads)
    throw mha::Error(fmt::format("--heads {}: the file's metadata says {} heads (the flag is for files without it)",
                                 o.heads, c.num_heads));
  if (o.add_zero_attn && !c.add_zero_attn)
    throw mha::Error("--add-zero-attn: the file's metadata says the layer has no add_zero_attn");
  const std::string layout = c.batch_first ? "batch-first" : "seq-first";
  if (!o.layout.empty() && o.layout != layout)
    throw mha::Error(fmt::format("--layout {}: the file's metadata says {}", o.layout, layout));
}

}  // namespace

int run_layer(const RunOptions& o) {
  if (o.threads > 0) mha::set_num_threads(o.threads);
  mha::MultiHeadAttention layer = for_flag("--weights", o.weights, [&] {
    const mha::SafetensorsFile file = mha::read_safetensors(o.weights);
    const bool ours = file.metadata.count("format") && file.metadata.at("format") == "mha";
    std::optional<mha::MultiHeadAttentionConfig> config;
    if (const auto format = file.metadata.find("format"); format != file.metadata.end() && !ours)
      throw mha::Error("the file's metadata says it holds '" + format->second +
                       "', not one attention layer: mha run takes a file written by MultiheadAttention.save (format "
                       "'mha') or a PyTorch nn.MultiheadAttention state_dict");
    if (!ours) config = config_from_shapes(file, o);
    mha::MultiHeadAttention loaded = mha::load_multi_head_attention(o.weights, config);
    if (ours) check_flags_against_metadata(loaded.config(), o);
    return loaded;
  });
  layer.eval();  // inference: no dropout, nothing kept for a backward

  const mha::DType dtype = layer.config().dtype;
  // Inputs must hold the layer's dtype, as in the Python API: a float64 query is not rounded to a float32
  // layer, nor a float32 one widened to a float64 layer. (A float16 .npy is read as float32, exactly, as
  // every reader of the library reads it.) Masks keep theirs (bool or float). A bfloat16 layer, which no
  // .npy can feed (NumPy has no bfloat16), takes float32 or float64 inputs rounded to bfloat16 (to
  // nearest even), as the Python API's bfloat16 layer does; its outputs are written as float32, exactly.
  auto read_input = [&](const std::string& flag, const std::string& path) {
    return for_flag(flag, path, [&] {
      mha::Tensor t = mha::read_npy(path);
      const bool floating = t.dtype() == mha::DType::Float32 || t.dtype() == mha::DType::Float64;
      if (dtype == mha::DType::BFloat16 && floating) return mha::Tensor::copy_of(t, dtype);
      if (t.dtype() != dtype)
        throw mha::Error(fmt::format("expected {} values (the layer's dtype), got {}: convert the array (NumPy: "
                                     "x.astype(np.{})), or use a layer saved as {}",
                                     mha::dtype_name(dtype), mha::dtype_name(t.dtype()), mha::dtype_name(dtype),
                                     mha::dtype_name(t.dtype())));
      return t;
    });
  };
  const mha::Tensor query = read_input("--query", o.query);
  const mha::Tensor key = o.key.empty() ? query.clone() : read_input("--key", o.key);
  const mha::Tensor value = o.value.empty() ? key.clone() : read_input("--value", o.value);

  mha::MultiHeadAttentionInputs in;
  mha::Tensor key_padding_mask, attn_mask;
  if (!o.key_padding_mask.empty()) {
    key_padding_mask =
        for_flag("--key-padding-mask", o.key_padding_mask, [&] { return mha::read_npy(o.key_padding_mask); });
    in.key_padding_mask = key_padding_mask.view();
  }
  if (!o.attn_mask.empty()) {
    attn_mask = for_flag("--attn-mask", o.attn_mask, [&] { return mha::read_npy(o.attn_mask); });
    in.attn_mask = attn_mask.view();
  }
  in.causal = o.causal;
  in.need_weights = !o.weights_out.empty();
  in.average_attn_weights = !o.per_head_weights;

  // A shape or mask error names its argument ("query: ...", "attn_mask: ..."); say which files.
  const mha::MultiHeadAttentionOutput result =
      for_flag("inputs", "(" + o.query + ")", [&] { return layer.forward(query, key, value, in); });
  for_flag("--out", o.out, [&] { mha::write_npy(o.out, result.out); });
  if (!o.weights_out.empty())
    for_flag("--weights-out", o.weights_out, [&] { mha::write_npy(o.weights_out, result.weights); });
  fmt::print("mha run: out {} -> {}{}\n", mha::shape_str(result.out.shape()), o.out,
             o.weights_out.empty()
                 ? ""
                 : fmt::format(", weights {} -> {}", mha::shape_str(result.weights.shape()), o.weights_out));
  return 0;
}

}  // namespace mha_cli
