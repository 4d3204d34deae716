// How the demo's model does on dates written the ways people write them, not only the trained formats:
// each held-out date in a set of realistic variations, read as `mha translate` reads it (normalised,
// then the answer checked and its confidence compared with the threshold); and what it answers outside
// the range it knows.
#pragma once

#include <string>
#include <vector>

#include "transformer/dates.hpp"
#include "transformer/training.hpp"

namespace mha_cli {

struct VariationResult {
  std::string name, example;  // e.g. "d month yyyy, lower case", "5 march 2021"
  bool trained = false;       // one of the trained formats as it stands (after normalisation)
  int right = 0;              // answered, and the answer is the date
  int unsure = 0;             // marked "?" (a check failed or the confidence is below the threshold)
  int confidently_wrong = 0;  // answered without "?", and wrong: what the checks exist to prevent
  int total = 0;
};

std::vector<VariationResult> measure_variations(transformer::Transformer<float>& model,
                                                const transformer::Vocabulary& vocab,
                                                const std::vector<transformer::DateExample>& examples,
                                                double unsure_below);

// What `mha translate` prints for inputs the model is not made for (years outside kFirstYear..kLastYear,
// dates no calendar has), answered by this model and checked as translate checks them.
struct OutsideAnswer {
  std::string input, line;  // e.g. "5 March 1492", "? 2002-03-05  the input's year 1492 is outside ..."
  bool marked = false;      // the line starts with "?"
};
std::vector<OutsideAnswer> answers_outside_the_range(transformer::Transformer<float>& model,
                                                     const transformer::Vocabulary& vocab, double unsure_below);

}  // namespace mha_cli
