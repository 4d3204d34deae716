// The heads a request switches off (head_set.hpp).
#include "explore/head_set.hpp"

#include <vector>

#include <fmt/core.h>

#include "explore/request_error.hpp"

namespace mha_cli::explore {

namespace tf = transformer;

namespace {

constexpr std::size_t kMaxEntries = 4096;  // more entries than any model here has heads: a bad request

tf::AttentionKind kind_named(const std::string& slug, std::size_t entry) {
  for (tf::AttentionKind kind : tf::kAttentionKinds)
    if (tf::kind_slug(kind) == slug) return kind;
  throw RequestError(fmt::format(
      "heads_off[{}]: unknown kind \"{}\" (expected \"encoder_self\", \"decoder_self\" or \"cross\")", entry, slug));
}

std::int64_t index_below(const nlohmann::json& value, std::int64_t bound, const char* what, std::size_t entry) {
  if (!value.is_number_integer())
    throw RequestError(fmt::format("heads_off[{}]: the {} must be an integer, got {}", entry, what, value.dump()));
  // Compared as read: a large unsigned value is not to wrap to a small or negative one.
  const bool inside = value.is_number_unsigned() ? value.get<std::uint64_t>() < static_cast<std::uint64_t>(bound)
                                                 : value.get<std::int64_t>() >= 0 && value.get<std::int64_t>() < bound;
  if (!inside)
    throw RequestError(fmt::format("heads_off[{}]: {} {} is outside 0..{}", entry, what, value.dump(), bound - 1));
  return value.get<std::int64_t>();
}

}  // namespace

HeadSet parse_heads_off(const nlohmann::json* heads_off, const ModelShape& shape) {
  HeadSet off;
  if (heads_off == nullptr || heads_off->is_null()) return off;
  if (!heads_off->is_array()) throw RequestError("heads_off: expected an array of [layer, kind, head]");
  if (heads_off->size() > kMaxEntries)
    throw RequestError(fmt::format("heads_off: {} entries, at most {} are accepted", heads_off->size(), kMaxEntries));
  for (std::size_t i = 0; i < heads_off->size(); ++i) {
    const nlohmann::json& entry = (*heads_off)[i];
    if (!entry.is_array() || entry.size() != 3 || !entry[1].is_string())
      throw RequestError(fmt::format("heads_off[{}]: expected [layer, kind, head], e.g. [0, \"cross\", 1]", i));
    const tf::AttentionKind kind = kind_named(entry[1].get<std::string>(), i);
    const std::int64_t layer = index_below(entry[0], shape.layers_of(kind), "layer", i);
    off.insert({kind, layer, index_below(entry[2], shape.heads, "head", i)});
  }
  return off;
}

nlohmann::json heads_json(const HeadSet& off) {
  nlohmann::json out = nlohmann::json::array();
  for (const HeadId& id : off) out.push_back({id.layer, std::string(tf::kind_slug(id.kind)), id.head});
  return out;
}

std::string head_set_key(const HeadSet& off) {
  std::string key;
  for (const HeadId& id : off)
    key += fmt::format("{}{}.{}.{}", key.empty() ? "" : " ", tf::kind_slug(id.kind), id.layer, id.head);
  return key;
}

void apply_head_set(tf::Transformer<float>& model, const HeadSet& off) {
  model.clear_head_gates();
  const auto heads = static_cast<std::size_t>(model.config().heads);
  for (tf::AttentionKind kind : tf::kAttentionKinds)
    for (std::int64_t layer = 0; layer < model.layers_of(kind); ++layer) {
      std::vector<float> gate(heads, 1.0f);
      bool any = false;
      for (std::size_t head = 0; head < heads; ++head)
        if (off.contains({kind, layer, static_cast<std::int64_t>(head)})) gate[head] = 0.0f, any = true;
      if (any) model.set_head_gate(kind, layer, std::move(gate));
    }
}

}  // namespace mha_cli::explore
