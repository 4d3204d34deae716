// `mha run`: applies a multi-head attention layer stored in a safetensors file to inputs in .npy files.
#pragma once

#include <cstdint>
#include <string>

namespace mha_cli {

struct RunOptions {
  std::string weights;            // safetensors file: the layer's parameters (+ config in __metadata__)
  std::string query, key, value;  // .npy inputs; key and value default to query (self-attention)
  std::string key_padding_mask;   // .npy bool [B, S] ([S] unbatched), optional
  std::string attn_mask;          // .npy bool or float [L, S] or [B*h, L, S], optional
  bool causal = false;
  std::string out;                // .npy output, like query with last dimension d_model
  std::string weights_out;        // .npy attention weights, optional
  bool per_head_weights = false;  // weights per head [B, h, L, S] instead of averaged [B, L, S]
  int threads = 0;                // 0: the library's default
  // The config, for files without mha's __metadata__ (e.g. written from a PyTorch state_dict); the
  // widths, bias and add_bias_kv are read from the parameters' shapes and names.
  std::int64_t heads = 0;
  bool add_zero_attn = false;
  std::string layout;  // "batch-first" or "seq-first"; required for a file without metadata, checked against one with
};

// Runs the layer; returns the exit status. Errors are mha::Error naming the flag and the file.
int run_layer(const RunOptions& options);

}  // namespace mha_cli
