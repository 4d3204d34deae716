// What the page shows for one input (input_analysis.hpp).
#include "explore/input_analysis.hpp"

#include <cmath>
#include <stdexcept>
#include <vector>

#include <fmt/core.h>

#include "commands/translate_checks.hpp"
#include "explore/request_error.hpp"
#include "transformer/dates.hpp"
#include "transformer/training.hpp"

namespace mha_cli::explore {

namespace tf = transformer;

namespace {

// Axis labels, one character each: "^" <bos>, "$" <eos>, "_" a space.
nlohmann::json labels(const std::vector<int>& ids, const tf::Vocabulary& vocab) {
  nlohmann::json out = nlohmann::json::array();
  for (int id : ids)
    out.push_back(id == tf::Vocabulary::kBos ? "^" : id == tf::Vocabulary::kEos ? "$" : vocab.token_label(id));
  return out;
}

// weights [1, h, L, S] -> [h][L][S], rounded to 4 decimals (what a page can show; a quarter of the bytes).
nlohmann::json head_maps(const mha::Tensor& weights) {
  const std::int64_t h = weights.size(1), L = weights.size(2), S = weights.size(3);
  const float* w = weights.data_as<float>();
  nlohmann::json heads = nlohmann::json::array();
  for (std::int64_t head = 0; head < h; ++head) {
    nlohmann::json rows = nlohmann::json::array();
    for (std::int64_t i = 0; i < L; ++i) {
      nlohmann::json row = nlohmann::json::array();
      for (std::int64_t j = 0; j < S; ++j) row.push_back(std::round(w[(head * L + i) * S + j] * 1e4) / 1e4);
      rows.push_back(std::move(row));
    }
    heads.push_back(std::move(rows));
  }
  return heads;
}

// The maps of the three kinds from one teacher-forced pass over <bos> y1 .. y10 (the decoder's own answer).
nlohmann::json attention_maps(tf::Transformer<float>& model, const tf::Vocabulary& vocab, tf::TokenBatch tokens) {
  const std::int64_t T = static_cast<std::int64_t>(tf::kIsoLength) + 1;
  tokens.target = model.greedy_decode(tokens, T, tf::Vocabulary::kBos, /*use_cache=*/true);  // y1 .. y10 <eos>
  tokens.target.insert(tokens.target.begin(), tf::Vocabulary::kBos);
  tokens.target.pop_back();  // <bos> y1 .. y10: the decoder's input when it wrote y1 .. y10 <eos>
  model.train(false);
  model.keep_attention_weights(true);
  model.forward(tokens);
  model.keep_attention_weights(false);
  const nlohmann::json source = labels(tokens.source, vocab), target = labels(tokens.target, vocab);
  nlohmann::json maps = nlohmann::json::array();
  for (tf::AttentionKind kind : tf::kAttentionKinds) {
    nlohmann::json layers = nlohmann::json::array();
    for (std::int64_t layer = 0; layer < model.layers_of(kind); ++layer)
      layers.push_back(head_maps(model.attention_weights(kind, layer)));
    const bool encoder = kind == tf::AttentionKind::EncoderSelf;
    maps.push_back({{"kind", tf::kind_slug(kind)},
                    {"name", tf::kind_name(kind)},
                    {"queries", encoder ? source : target},
                    {"keys", kind == tf::AttentionKind::DecoderSelf ? target : source},
                    {"layers", std::move(layers)}});
  }
  return maps;
}

}  // namespace

std::string readable_input(const std::string& text, const tf::Vocabulary& vocab) {
  if (text.size() > kMaxInputLength)
    throw RequestError(
        fmt::format("the input has {} characters; at most {} are accepted", text.size(), kMaxInputLength));
  const std::string normalized = tf::normalize_date_text(text);
  if (normalized.empty()) throw RequestError("the input is empty: type a date such as \"Friday, 5 March 2021\"");
  try {
    vocab.encode(normalized);
  } catch (const std::invalid_argument& e) {
    throw RequestError(fmt::format("the input: {}", e.what()));
  }
  return normalized;
}

nlohmann::json analyse_input(tf::Transformer<float>& model, const tf::Vocabulary& vocab, const std::string& normalized,
                             const HeadSet& off, double unsure_below) {
  apply_head_set(model, off);
  const tf::Translation answer = tf::translate_with_confidence(model, vocab, {normalized}).at(0);
  const std::string doubt = translation_doubt(normalized, answer, unsure_below);
  const std::vector<tf::DateExample> example{{normalized, std::string(tf::kIsoLength, '0'), {}, {}}};
  return {{"normalized", normalized},
          {"translation", answer.text},
          {"confidence", answer.confidence},
          {"valid", answer_doubt(normalized, answer.text).empty()},
          {"confident", answer.confidence >= unsure_below},
          {"doubt", doubt},
          {"line", answer_line(answer.text, doubt)},
          {"maps", attention_maps(model, vocab, tf::token_batch(tf::make_batch(example, vocab)))}};
}

}  // namespace mha_cli::explore
