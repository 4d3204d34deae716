// The held-out dates `mha demo` measured the checkpoint's accuracy on, and the accuracy on them with a
// set of heads switched off.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "explore/accuracy_cache.hpp"
#include "explore/head_set.hpp"
#include "transformer/dates.hpp"
#include "transformer/transformer.hpp"
#include "transformer/vocabulary.hpp"

namespace mha_cli::explore {

// The demo's held-out set, from the checkpoint's metadata: "held_out_seed" and "held_out_examples"
// (written by `mha demo`); for a checkpoint from before they were written, the seed the demo used
// ("seed" + 1000, seed 1 when absent) and its default count, 1000. Throws std::runtime_error for
// values that are not numbers, or a count outside 1..100000.
std::vector<transformer::DateExample> held_out_examples(const std::map<std::string, std::string>& metadata);

// Exact matches of greedy decoding on `examples` with the heads in `off` switched off.
HeldOutAccuracy held_out_accuracy(transformer::Transformer<float>& model, const transformer::Vocabulary& vocab,
                                  const std::vector<transformer::DateExample>& examples, const HeadSet& off);

}  // namespace mha_cli::explore
