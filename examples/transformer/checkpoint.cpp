// Checkpoint save and load (checkpoint.hpp).
#include "transformer/checkpoint.hpp"

#include <stdexcept>

#include "mha/io.hpp"
#include "transformer/vocabulary.hpp"

namespace transformer {

namespace {

std::map<std::string, std::string> config_metadata(const TransformerConfig& c) {
  return {{"format", kCheckpointFormat},
          {"vocabulary", std::string(Vocabulary::kAlphabet)},
          {"vocab", std::to_string(c.vocab)},
          {"d_model", std::to_string(c.d_model)},
          {"heads", std::to_string(c.heads)},
          {"d_ff", std::to_string(c.d_ff)},
          {"encoder_layers", std::to_string(c.encoder_layers)},
          {"decoder_layers", std::to_string(c.decoder_layers)},
          {"pre_norm", c.pre_norm ? "true" : "false"}};
}

std::int64_t integer(const std::map<std::string, std::string>& m, const std::string& key, const std::string& path) {
  const auto it = m.find(key);
  if (it == m.end()) throw std::runtime_error(path + ": the checkpoint's metadata has no \"" + key + "\"");
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    throw std::runtime_error(path + ": metadata \"" + key + "\" is not an integer: \"" + it->second + "\"");
  }
}

}  // namespace

void save_checkpoint(Transformer<float>& model, const std::string& path,
                     const std::map<std::string, std::string>& extra_metadata) {
  std::map<std::string, mha::TensorView> tensors;
  for (const Parameter<float>* p : model.parameters())
    tensors.emplace(p->name, mha::TensorView(p->value.data(), mha::DType::Float32, p->shape));
  std::map<std::string, std::string> metadata = extra_metadata;
  for (auto& [key, value] : config_metadata(model.config())) metadata[key] = value;
  mha::write_safetensors(path, tensors, metadata);
}

Checkpoint load_checkpoint(const std::string& path) {
  mha::SafetensorsFile file;
  try {
    file = mha::read_safetensors(path, mha::DType::Float32);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what());
  }
  const auto& m = file.metadata;
  if (!m.contains("format") || m.at("format") != kCheckpointFormat)
    throw std::runtime_error(path + ": not a date-task Transformer checkpoint (its metadata lacks \"format\": \"" +
                             std::string(kCheckpointFormat) + "\")");
  if (!m.contains("vocabulary") || m.at("vocabulary") != Vocabulary::kAlphabet)
    throw std::runtime_error(path + ": written for another vocabulary than this program's");
  TransformerConfig c;
  c.vocab = integer(m, "vocab", path);
  c.d_model = integer(m, "d_model", path);
  c.heads = integer(m, "heads", path);
  c.d_ff = integer(m, "d_ff", path);
  c.encoder_layers = integer(m, "encoder_layers", path);
  c.decoder_layers = integer(m, "decoder_layers", path);
  c.pre_norm = m.contains("pre_norm") && m.at("pre_norm") == "true";
  c.dropout = 0.0;
  c.attention_dropout = 0.0;
  if (c.vocab != Vocabulary().size())
    throw std::runtime_error(path + ": vocab = " + std::to_string(c.vocab) + ", this program's vocabulary has " +
                             std::to_string(Vocabulary().size()) + " ids");
  Checkpoint out;
  try {
    out.model = std::make_unique<Transformer<float>>(c, 0);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  std::size_t used = 0;
  for (Parameter<float>* p : out.model->parameters()) {
    const auto it = file.tensors.find(p->name);
    if (it == file.tensors.end()) throw std::runtime_error(path + ": missing parameter \"" + p->name + "\"");
    if (it->second.shape() != p->shape)
      throw std::runtime_error(path + ": parameter \"" + p->name + "\" has shape " +
                               mha::shape_str(it->second.shape()) + ", expected " + mha::shape_str(p->shape));
    const float* src = it->second.data_as<float>();
    p->value.assign(src, src + p->numel());
    ++used;
  }
  if (used != file.tensors.size())
    throw std::runtime_error(path + ": " + std::to_string(file.tensors.size() - used) +
                             " tensors that are not parameters of the model");
  out.model->train(false);
  out.metadata = m;
  return out;
}

}  // namespace transformer
