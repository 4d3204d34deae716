// The checks `mha translate` (and the demo's table of realistic variations) make of an answer: is it
// a date of the form yyyy-mm-dd, a calendar date, in the years the model knows, and the year the input
// states?
#pragma once

#include <string>

#include "transformer/training.hpp"

namespace mha_cli {

// Why the answer for `text` (already normalised, transformer::normalize_date_text) is not to be
// trusted, or empty: not of the form yyyy-mm-dd, not a calendar date, outside 1950-2049, or not the
// year the input states (its last four-digit run, the first four digits of an eight-digit run, or else
// one of its two-digit runs; an input with none of them states no year, as every trained format does).
std::string answer_doubt(const std::string& text, const std::string& answer);

// answer_doubt, or else "low confidence ..." when the decoder's confidence is below `unsure_below`
// (the checkpoint's threshold; 0: none): why `mha translate` marks the translation of `text` with "?".
std::string translation_doubt(const std::string& text, const transformer::Translation& translation,
                              double unsure_below);

// The checkpoint's "unsure_below" (its text `text`): a probability in [0, 1]. Throws std::runtime_error
// naming the checkpoint file otherwise.
double confidence_threshold(const std::string& text, const std::string& checkpoint);

// The line `mha translate` prints for an answer: the answer itself when `doubt` is empty, else
// "? ANSWER  DOUBT".
std::string answer_line(const std::string& answer, const std::string& doubt);

}  // namespace mha_cli
