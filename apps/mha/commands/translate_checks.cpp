// The checks `mha translate` makes of each answer (translate_checks.hpp).
#include "commands/translate_checks.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <vector>

#include <fmt/core.h>

#include "render/terminal_text.hpp"
#include "transformer/dates.hpp"

namespace mha_cli {

namespace {

// The runs of digits in the input ("5 Mar 21": "5", "21"), where every trained format states its year.
std::vector<std::string> digit_runs(const std::string& text) {
  std::vector<std::string> runs;
  for (std::size_t i = 0; i < text.size();) {
    std::size_t j = i;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    if (j > i) runs.push_back(text.substr(i, j - i));
    i = j > i ? j : i + 1;
  }
  return runs;
}

// Why `year` is not the year the input states, or empty. Every trained format states it: in four
// digits (the last run of four, or the first four of a run of eight, yyyymmdd), or else in two (then
// one of the two-digit runs must be year % 100).
std::string year_disagreement(const std::string& text, int year) {
  const std::vector<std::string> runs = digit_runs(text);
  std::optional<int> four;
  bool any_two = false, two_matches = false;
  for (const std::string& run : runs) {
    if (run.size() == 4 || run.size() == 8) four = std::stoi(run.substr(0, 4));  // yyyy, or yyyymmdd
    if (run.size() == 2) any_two = true, two_matches = two_matches || std::stoi(run) == year % 100;
  }
  if (four) {
    if (*four == year) return "";
    if (*four < transformer::kFirstYear || *four > transformer::kLastYear)
      return fmt::format("the input's year {} is outside the years the model knows ({}-{})", *four,
                         transformer::kFirstYear, transformer::kLastYear);
    return fmt::format("the input says {}", *four);
  }
  if (!any_two) return "the input states no year, as every trained format does";
  return two_matches ? "" : fmt::format("no two-digit year of the input is {:02}", year % 100);
}

}  // namespace

// Why the model's answer for `text` (normalised) is not to be trusted, or empty: not of the form yyyy-mm-dd, not a
// calendar date, outside the trained years, or not the year the input states (year_disagreement).
std::string answer_doubt(const std::string& text, const std::string& answer) {
  int year = 0, month = 0, day = 0;
  char dash1 = 0, dash2 = 0;
  const bool iso = answer.size() == transformer::kIsoLength &&
                   std::all_of(answer.begin(), answer.end(), [](char c) { return std::isdigit(c) || c == '-'; }) &&
                   std::sscanf(answer.c_str(), "%4d%c%2d%c%2d", &year, &dash1, &month, &dash2, &day) == 5 &&
                   dash1 == '-' && dash2 == '-';
  if (!iso) return "not a date of the form yyyy-mm-dd";
  if (month < 1 || month > 12 || day < 1 || day > transformer::days_in_month(year, month)) return "not a calendar date";
  if (year < transformer::kFirstYear || year > transformer::kLastYear)
    return fmt::format("outside the years the model knows ({}-{})", transformer::kFirstYear, transformer::kLastYear);
  return year_disagreement(text, year);
}

std::string translation_doubt(const std::string& text, const transformer::Translation& translation,
                              double unsure_below) {
  if (std::string why = answer_doubt(text, translation.text); !why.empty()) return why;
  if (translation.confidence < unsure_below)
    return fmt::format("low confidence ({:.2f}, below the {:.2f} that 99% of correct held-out answers reach)",
                       translation.confidence, unsure_below);
  return "";
}

double confidence_threshold(const std::string& text, const std::string& checkpoint) {
  double value = -1.0;
  std::size_t used = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || !(value >= 0.0 && value <= 1.0))
    throw std::runtime_error(fmt::format("{}: metadata \"unsure_below\" is not a probability: {}",
                                         quoted_printable(checkpoint), quoted_printable(text)));
  return value;
}

std::string answer_line(const std::string& answer, const std::string& doubt) {
  return doubt.empty() ? answer : fmt::format("? {}  {}", answer, doubt);
}

}  // namespace mha_cli
