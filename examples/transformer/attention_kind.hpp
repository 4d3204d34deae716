// The three uses of attention in the Transformer (section 3.2.3), as the model's blocks are named.
#pragma once

#include <array>
#include <string_view>

namespace transformer {

enum class AttentionKind {
  EncoderSelf,  // encoder self-attention: the source attends to the source
  DecoderSelf,  // decoder masked self-attention: each target position attends to those before it
  Cross,        // encoder-decoder attention: the target attends to the encoder's output
};
inline constexpr std::array<AttentionKind, 3> kAttentionKinds = {AttentionKind::EncoderSelf, AttentionKind::DecoderSelf,
                                                                 AttentionKind::Cross};

// "encoder_self", "decoder_self", "cross": the names the demo's map files and `mha explore` use.
constexpr std::string_view kind_slug(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::EncoderSelf: return "encoder_self";
    case AttentionKind::DecoderSelf: return "decoder_self";
    case AttentionKind::Cross: return "cross";
  }
  return "";
}

// "encoder self-attention", "decoder masked self-attention", "encoder-decoder attention".
constexpr std::string_view kind_name(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::EncoderSelf: return "encoder self-attention";
    case AttentionKind::DecoderSelf: return "decoder masked self-attention";
    case AttentionKind::Cross: return "encoder-decoder attention";
  }
  return "";
}

}  // namespace transformer
