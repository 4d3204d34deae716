// A MultiHeadAttention layer in a safetensors file: parameters under PyTorch's state_dict names and
// the config as string metadata (see include/mha/io.hpp).
#include <charconv>
#include <cstring>
#include <system_error>

#include "io/binary_file.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"

namespace mha {

namespace {

using io::fail;
using io::printable;

constexpr const char* kFormat = "mha";

std::string to_string(double v) {
  char buffer[32];
  const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, v);  // shortest exact form
  return std::string(buffer, end);
}

std::map<std::string, std::string> config_metadata(const MultiHeadAttentionConfig& c) {
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  return {{"format", kFormat},
          {"d_model", std::to_string(c.d_model)},
          {"num_heads", std::to_string(c.num_heads)},
          {"num_kv_heads", std::to_string(c.num_kv_heads)},
          {"d_k", std::to_string(c.d_k)},
          {"d_v", std::to_string(c.d_v)},
          {"kdim", std::to_string(c.kdim)},
          {"vdim", std::to_string(c.vdim)},
          {"bias", flag(c.bias)},
          {"add_bias_kv", flag(c.add_bias_kv)},
          {"add_zero_attn", flag(c.add_zero_attn)},
          {"sinks", flag(c.sinks)},
          {"rotary_dim", std::to_string(c.rotary_dim)},
          {"rotary_base", to_string(c.rotary_base)},
          {"rotary_interleaved", flag(c.rotary_interleaved)},
          {"batch_first", flag(c.batch_first)},
          {"dropout", to_string(c.dropout)},
          {"dtype", dtype_name(c.dtype)}};
}

// Reads the config back from metadata written by config_metadata; every value is checked.
class MetadataReader {
 public:
  MetadataReader(const std::map<std::string, std::string>& metadata, const std::string& file)
      : metadata_(metadata), file_(file) {}

  const std::string& text(const std::string& key) const {
    const auto it = metadata_.find(key);
    if (it == metadata_.end()) fail(file_, "__metadata__: missing " + printable(key) + " of the layer's config");
    return it->second;
  }
  std::int64_t integer(const std::string& key) const {
    const std::string& s = text(key);
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc::result_out_of_range)
      fail(file_, "__metadata__: " + key + " must be an integer that fits 64 bits, got " + printable(s));
    if (ec != std::errc() || end != s.data() + s.size() || s.empty())
      fail(file_, "__metadata__: " + key + " must be an integer, got " + printable(s));
    return v;
  }
  double real(const std::string& key) const {
    const std::string& s = text(key);
    double v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || s.empty())
      fail(file_, "__metadata__: " + key + " must be a number, got " + printable(s));
    return v;
  }
  bool flag(const std::string& key) const {
    const std::string& s = text(key);
    if (s == "true") return true;  // exactly what config_metadata writes
    if (s == "false") return false;
    fail(file_, "__metadata__: " + key + " must be true or false, got " + printable(s));
  }
  DType dtype(const std::string& key) const {
    const std::string& s = text(key);
    if (s == "float32") return DType::Float32;
    if (s == "float64") return DType::Float64;
    if (s == "bfloat16") return DType::BFloat16;
    fail(file_, "__metadata__: " + key + " must be float32, float64 or bfloat16, got " + printable(s));
  }

 private:
  const std::map<std::string, std::string>& metadata_;
  const std::string& file_;
};

}  // namespace

MultiHeadAttentionConfig config_from_metadata(const std::map<std::string, std::string>& metadata,
                                              const std::string& file) {
  const auto format = metadata.find("format");
  if (format == metadata.end() || format->second != kFormat)
    fail(file, "__metadata__ holds no MultiHeadAttention config (\"format\": \"mha\", as save_safetensors "
               "writes); pass a config to load a file written elsewhere, such as one from PyTorch");
  const MetadataReader m(metadata, file);
  MultiHeadAttentionConfig c;
  c.d_model = m.integer("d_model");
  c.num_heads = m.integer("num_heads");
  // Files written before grouped-query attention have no num_kv_heads: one key/value head per head.
  c.num_kv_heads = metadata.count("num_kv_heads") ? m.integer("num_kv_heads") : 0;
  c.d_k = m.integer("d_k");
  c.d_v = m.integer("d_v");
  c.kdim = m.integer("kdim");
  c.vdim = m.integer("vdim");
  c.bias = m.flag("bias");
  c.add_bias_kv = m.flag("add_bias_kv");
  c.add_zero_attn = m.flag("add_zero_attn");
  c.sinks = metadata.count("sinks") ? m.flag("sinks") : false;                // files written before sinks have none
  c.rotary_dim = metadata.count("rotary_dim") ? m.integer("rotary_dim") : 0;  // likewise before rotary
  c.rotary_base = metadata.count("rotary_base") ? m.real("rotary_base") : 10000.0;
  c.rotary_interleaved = metadata.count("rotary_interleaved") ? m.flag("rotary_interleaved") : false;
  c.batch_first = m.flag("batch_first");
  c.dropout = m.real("dropout");
  c.dtype = m.dtype("dtype");
  return c;
}

void save_safetensors(const MultiHeadAttention& layer, const std::string& path) {
  write_safetensors(path, layer.state_dict(), config_metadata(layer.config()));
}

MultiHeadAttention load_multi_head_attention(const std::string& path,
                                             const std::optional<MultiHeadAttentionConfig>& config) {
  const SafetensorsFile file = read_safetensors(path);  // dtypes as stored; converted on loading
  const MultiHeadAttentionConfig c = config ? *config : config_from_metadata(file.metadata, path);
  std::map<std::string, TensorView> state;
  for (const auto& [name, tensor] : file.tensors) state.emplace(name, tensor.view());
  try {
    MultiHeadAttention layer(c);
    layer.load_state_dict(state);
    return layer;
  } catch (const Error& e) {
    fail(path, e.what());  // the config or the parameters do not fit: say which file
  }
}

}  // namespace mha
