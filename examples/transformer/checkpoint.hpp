// Checkpoints of the date-task Transformer in safetensors (the library's writer and reader, io.hpp):
// every parameter as F32 under its name ("decoder.0.cross_attn.in_proj_weight", ...), and in
// "__metadata__" the format tag, the model config, the vocabulary's alphabet and whatever the caller
// adds (training settings, accuracy).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "transformer/transformer.hpp"

namespace transformer {

inline constexpr const char* kCheckpointFormat = "mha-transformer-dates";

void save_checkpoint(Transformer<float>& model, const std::string& path,
                     const std::map<std::string, std::string>& extra_metadata = {});

struct Checkpoint {
  std::unique_ptr<Transformer<float>> model;    // in evaluation mode
  std::map<std::string, std::string> metadata;  // everything in "__metadata__"
};

// Throws std::runtime_error naming the file when it cannot be read, is not such a checkpoint, was
// written for another vocabulary, or lacks a parameter / has one of the wrong shape.
Checkpoint load_checkpoint(const std::string& path);

}  // namespace transformer
