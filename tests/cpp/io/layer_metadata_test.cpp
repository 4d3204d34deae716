// A layer's config read back from a safetensors file's metadata (config_from_metadata and
// load_multi_head_attention): only what save_safetensors writes is accepted. Booleans are exactly
// "true" / "false", integers must fit 64 bits, and sizes whose products overflow (num_heads * d_k) are
// refused naming the file, never built into a layer with wrapped (zero or negative) shapes.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "support/io_bytes.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using Metadata = std::map<std::string, std::string>;

mha::MultiHeadAttentionConfig small_config() {
  mha::MultiHeadAttentionConfig c;
  c.d_model = 4;
  c.num_heads = 2;
  return c;
}

const mha::MultiHeadAttention& small_layer() {
  static const mha::MultiHeadAttention layer(small_config(), 1);
  return layer;
}

// What save_safetensors writes for small_layer().
Metadata saved_metadata() {
  TempDir dir("metadata");
  mha::save_safetensors(small_layer(), dir / "layer.safetensors");
  return mha::read_safetensors(dir / "layer.safetensors").metadata;
}

// Loading small_layer() saved with metadata[key] = value must throw mha::Error naming the file, the
// key and the value.
void expect_refused(const std::string& key, const std::string& value, const std::string& reason) {
  TempDir dir("metadata_refused");
  const std::string path = dir / "f.safetensors";
  Metadata metadata = saved_metadata();
  metadata[key] = value;
  mha::write_safetensors(path, small_layer().state_dict(), metadata);
  try {
    mha::load_multi_head_attention(path);
    ADD_FAILURE() << key << " = '" << value << "' accepted";
  } catch (const mha::Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(path + ": __metadata__: " + key + " must be " + reason, 0), 0u) << message;
    EXPECT_NE(message.find("'" + value + "'"), std::string::npos) << message;
  }
}

TEST(IoLayerMetadata, WhatTheWriterWritesReadsBack) {
  const auto a = mha::config_from_metadata(saved_metadata(), "f.safetensors");
  const auto& b = small_layer().config();
  EXPECT_EQ(std::tie(a.d_model, a.num_heads, a.d_k, a.d_v, a.kdim, a.vdim, a.bias, a.add_bias_kv, a.add_zero_attn,
                     a.batch_first, a.dropout, a.dtype),
            std::tie(b.d_model, b.num_heads, b.d_k, b.d_v, b.kdim, b.vdim, b.bias, b.add_bias_kv, b.add_zero_attn,
                     b.batch_first, b.dropout, b.dtype));
}

TEST(IoLayerMetadata, BooleansAreExactlyTrueOrFalse) {
  for (const char* key : {"bias", "add_bias_kv", "add_zero_attn", "batch_first"})
    for (const char* value : {"True", "False", "TRUE", "yes", "1", "0", "", " true", "true "})
      expect_refused(key, value, "true or false");
}

TEST(IoLayerMetadata, IntegersMustBeDecimalAndFit64Bits) {
  for (const char* key : {"d_model", "num_heads", "d_k", "d_v", "kdim", "vdim"}) {
    for (const char* value : {"x", "", "2.5", "0x10", " 4", "4 "}) expect_refused(key, value, "an integer");
    expect_refused(key, "99999999999999999999", "an integer that fits 64 bits");
  }
}

// num_heads = d_k = d_v = 2^32: num_heads * d_k overflows. The layer used to be built with zero-size
// weights; the load now fails naming the file and the product.
TEST(IoLayerMetadata, OverflowingSizesAreRefusedNamingTheFile) {
  TempDir dir("metadata_overflow");
  const std::string path = dir / "huge.safetensors";
  Metadata metadata = saved_metadata();
  for (const char* key : {"d_model", "num_heads", "d_k", "d_v", "kdim", "vdim"}) metadata[key] = "4294967296";
  mha::write_safetensors(path, small_layer().state_dict(), metadata);
  try {
    mha::load_multi_head_attention(path);
    FAIL() << "loaded";
  } catch (const mha::Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(path + ": num_heads * d_k = 4294967296 * 4294967296 is too large", 0), 0u) << message;
  }
}

}  // namespace
}  // namespace mha_test
