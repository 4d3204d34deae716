// Checkpoints: a saved model loads back with every parameter equal and decodes the same tokens; files
// that are not such checkpoints are refused with a message naming the file.
#include <filesystem>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>

#include "mha/io.hpp"
#include "tiny_config.hpp"
#include "transformer/checkpoint.hpp"
#include "transformer/training.hpp"

namespace transformer {
namespace {

std::filesystem::path scratch(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("mha_transformer_" + name + "_" + std::to_string(::getpid()));
}

TransformerConfig small_date_config(bool pre_norm) {  // the tiny model, over the dates' vocabulary
  TransformerConfig c = testing::tiny_config(pre_norm);
  c.vocab = Vocabulary().size();
  return c;
}

TEST(Checkpoint, RoundTripKeepsParametersAndTranslations) {
  for (bool pre_norm : {false, true}) {
    Transformer<float> model(small_date_config(pre_norm), 7);
    Rng rng(8);
    for (Parameter<float>* p : model.parameters())  // not the initial values, so loading must copy them
      for (auto& v : p->value) v += static_cast<float>(rng.uniform(-0.3, 0.3));
    const auto path = scratch("roundtrip").string();
    save_checkpoint(model, path, {{"note", "test"}});
    Checkpoint loaded = load_checkpoint(path);
    std::filesystem::remove(path);

    EXPECT_EQ(loaded.metadata.at("note"), "test");
    EXPECT_EQ(loaded.model->config().pre_norm, pre_norm);
    EXPECT_FALSE(loaded.model->training());
    const ParameterRefs<float> a = model.parameters(), b = loaded.model->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i]->name, b[i]->name);
      EXPECT_EQ(a[i]->value, b[i]->value) << a[i]->name;
    }
    const Vocabulary vocab;
    std::vector<std::string> sources;
    for (const auto& e : sample_dates(Split::HeldOut, 3, 12)) sources.push_back(e.source);
    EXPECT_EQ(translate(model, vocab, sources), translate(*loaded.model, vocab, sources));
  }
}

TEST(Checkpoint, RefusesFilesThatAreNotCheckpoints) {
  const auto path = scratch("other").string();
  const float x[3] = {1, 2, 3};
  mha::write_safetensors(path, {{"x", mha::TensorView(x, mha::DType::Float32, {3})}});
  try {
    load_checkpoint(path);
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a date-task Transformer checkpoint"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
  EXPECT_THROW(load_checkpoint(path), std::runtime_error);  // missing file
}

TEST(Checkpoint, RefusesAMissingParameter) {
  Transformer<float> model(small_date_config(false), 1);
  const auto full = scratch("full").string(), partial = scratch("partial").string();
  save_checkpoint(model, full);
  mha::SafetensorsFile file = mha::read_safetensors(full);
  std::map<std::string, mha::TensorView> tensors;
  for (const auto& [name, t] : file.tensors)
    if (name != "decoder.1.cross_attn.out_proj.bias") tensors.emplace(name, t.view());
  mha::write_safetensors(partial, tensors, file.metadata);
  try {
    load_checkpoint(partial);
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing parameter \"decoder.1.cross_attn.out_proj.bias\""), std::string::npos)
        << e.what();
  }
  std::filesystem::remove(full);
  std::filesystem::remove(partial);
}

}  // namespace
}  // namespace transformer
