// The heads a request switches off: (kind, layer, head) triples, read from the API's JSON
// ("heads_off": [[layer, "kind", head], ...]), checked against the model, and applied to it as head
// gates (0 for a head that is off, 1 for the others).
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "transformer/attention_kind.hpp"
#include "transformer/transformer.hpp"

namespace mha_cli::explore {

struct HeadId {
  transformer::AttentionKind kind = transformer::AttentionKind::EncoderSelf;
  std::int64_t layer = 0, head = 0;
  friend auto operator<=>(const HeadId&, const HeadId&) = default;
};
using HeadSet = std::set<HeadId>;

// The model's attention blocks: layers of each kind and heads per block.
struct ModelShape {
  std::int64_t encoder_layers = 0, decoder_layers = 0, heads = 0;
  std::int64_t layers_of(transformer::AttentionKind kind) const {
    return kind == transformer::AttentionKind::EncoderSelf ? encoder_layers : decoder_layers;
  }
};

// `heads_off` (absent: null) as a set. Throws RequestError naming the entry for anything but an
// array of [layer, kind, head] with integer layer and head inside the model and kind one of
// "encoder_self", "decoder_self", "cross".
HeadSet parse_heads_off(const nlohmann::json* heads_off, const ModelShape& shape);

// The set as the API writes it: [[layer, "kind", head], ...] in a fixed order.
nlohmann::json heads_json(const HeadSet& off);

// A text that names the set, the same for the same set in any order ("cross.1.0 encoder_self.0.3").
std::string head_set_key(const HeadSet& off);

// Gates on every attention block of `model`: 0 for the heads in `off`, 1 for the others (blocks with
// no head off get no gate at all).
void apply_head_set(transformer::Transformer<float>& model, const HeadSet& off);

}  // namespace mha_cli::explore
