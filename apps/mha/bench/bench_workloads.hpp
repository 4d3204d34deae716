// What `mha bench` times: the attention core (Kernel::Flash) and the whole MultiHeadAttention layer,
// with their FLOP counts (docs/DESIGN.md section 5).
//
// Legend: B batch, h heads, N = L = S sequence length (self-attention), d = d_k = d_v per-head width,
// E = d_model = h * d.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mha/attention.hpp"
#include "mha/multi_head_attention.hpp"
#include "mha/tensor.hpp"

namespace mha_cli::bench {

enum class Pass { Forward, ForwardBackward };
const char* pass_name(Pass pass);  // "fwd", "fwdbwd"
Pass parse_pass(const std::string& name);

// The attention core's forward FLOPs: 4 B h L S d (two products of 2 L S d each), half when causal.
// Its backward does 2.5 times that (five products instead of two).
double attention_forward_flops(std::int64_t B, std::int64_t h, std::int64_t N, std::int64_t d, bool causal);
inline constexpr double kBackwardFlopsRatio = 2.5;

// The whole layer's FLOPs on self-attention: the four projections (q, k, v in, and out) are
// 2 B N E (4 E) forward and twice that again backward (input and weight gradients); the attention
// core as above.
double layer_flops(std::int64_t B, std::int64_t N, std::int64_t E, std::int64_t h, bool causal, Pass pass);

// A float32 tensor of `shape`, uniform in [-1, 1), from a fixed seed.
mha::Tensor random_tensor(mha::Shape shape, unsigned seed);

// Where the rows of one head lie in memory.
enum class HeadLayout {
  Contiguous,   // [B, h, N, d]: a head's rows are adjacent (row stride d)
  Interleaved,  // [B, N, h, d] viewed as [B, h, N, d]: the heads of one position are adjacent (row stride
                // h*d), as in a projection's output [B*N, h*d]; how MultiHeadAttention calls the core
};

// q, k, v, dout: [B, h, N, d] float32 views, uniform in [-1, 1); dout only with_backward.
class CoreWorkload {
 public:
  CoreWorkload(std::int64_t B, std::int64_t h, std::int64_t N, std::int64_t d, bool causal, bool with_backward,
               HeadLayout layout = HeadLayout::Contiguous);
  void forward();   // out [B, h, N, d], lse [B, h, N]
  void backward();  // dq, dk, dv from the last forward()'s out and lse

 private:
  mha::Tensor q_, k_, v_, dout_;                          // storage, in `layout`
  mha::TensorView q_view_, k_view_, v_view_, dout_view_;  // [B, h, N, d]
  mha::AttentionOptions options_;
  mha::AttentionResult result_;
};

// Self-attention through mha::MultiHeadAttention(E, h, batch_first, dtype) on x [B, N, E]:
// Forward: eval mode, need_weights = false. ForwardBackward: train mode (dropout 0), forward, then
// backward(dout), dout [B, N, E].
class LayerWorkload {
 public:
  LayerWorkload(std::int64_t B, std::int64_t N, std::int64_t E, std::int64_t h, bool causal, Pass pass,
                mha::DType dtype = mha::DType::Float32);
  void run();

 private:
  Pass pass_;
  mha::MultiHeadAttention module_;
  mha::MultiHeadAttentionInputs inputs_;
  mha::Tensor x_, dout_;  // [B, N, E]
};

}  // namespace mha_cli::bench
