// What the page shows for one input: the translation, the decoder's confidence in it and the checks of
// `mha translate` (translate_checks.hpp), and the attention maps of every layer x head x kind, with a
// given set of heads switched off.
//
// Legend: S source characters, T = 11 decoder positions (<bos> and the 10 characters of the date),
// h heads.
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

#include "explore/head_set.hpp"
#include "transformer/transformer.hpp"
#include "transformer/vocabulary.hpp"

namespace mha_cli::explore {

// The longest input accepted, in bytes: the trained formats write at most 36 characters.
inline constexpr std::size_t kMaxInputLength = 64;

// `text` as the model reads it (transformer::normalize_date_text). Throws RequestError when it is
// empty, longer than kMaxInputLength, or has a character outside the vocabulary (named, with its
// position).
std::string readable_input(const std::string& text, const transformer::Vocabulary& vocab);

// The answer for `normalized` (from readable_input) with the heads in `off` switched off (their head
// gates 0), as JSON:
//   translation, confidence    the greedy answer and its lowest token probability
//   valid                      the answer is a calendar date of the years the model knows, and the
//                              input's year (translate_checks.hpp's answer_doubt is empty)
//   confident                  confidence >= unsure_below (the checkpoint's threshold)
//   doubt, line                why `mha translate` marks it "?" (empty: it does not), and its line
//   maps                       [{kind, name, queries: [T or S labels], keys: [...],
//                                layers: [layer][head][query][key] weights}] for the three kinds
// The decoder's maps are those of the teacher-forced pass over <bos> and its own answer.
nlohmann::json analyse_input(transformer::Transformer<float>& model, const transformer::Vocabulary& vocab,
                             const std::string& normalized, const HeadSet& off, double unsure_below);

}  // namespace mha_cli::explore
