// The demo's table of realistic variations (date_variations.hpp).
#include "commands/date_variations.hpp"

#include <functional>

#include <fmt/core.h>

#include "commands/translate_checks.hpp"

namespace mha_cli {

namespace tf = transformer;

namespace {

std::string with_case(std::string s, bool upper) {
  for (char& c : s)
    if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    else if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

std::string doubled_spaces(const std::string& s) {
  std::string out = "  ";
  for (const char c : s) out += c == ' ' ? std::string("  ") : std::string(1, c);
  return out + "  ";
}

struct Variation {
  const char* name;
  bool trained;
  std::function<std::string(tf::Date)> write;
};

std::string two(int n) { return fmt::format("{:02}", n); }

const std::vector<Variation>& variations() {
  using F = tf::DateFormat;
  static const std::vector<Variation> v = {
      {"yyyy-mm-dd (the output format)", true, [](tf::Date d) { return tf::format_date(d, F::IsoDashYMD); }},
      {"yyyymmdd", true, [](tf::Date d) { return tf::format_date(d, F::CompactYMD); }},
      {"d month yyyy, lower case", true,
       [](tf::Date d) { return with_case(tf::format_date(d, F::DayMonthYear), false); }},
      {"MONTH d, YYYY, capitals", true,
       [](tf::Date d) { return with_case(tf::format_date(d, F::MonthDayYear), true); }},
      {"d Month yyyy with a trailing period", true,
       [](tf::Date d) { return tf::format_date(d, F::DayMonthYear) + "."; }},
      {"d Month yyyy, doubled spaces", true,
       [](tf::Date d) { return doubled_spaces(tf::format_date(d, F::DayMonthYear)); }},
      {"Mon dd yyyy (zero-padded day)", true, [](tf::Date d) { return tf::format_date(d, F::MonPaddedDayYear); }},
      {"d.m.yyyy", true, [](tf::Date d) { return tf::format_date(d, F::ShortDotDMY); }},
      {"dd.mm.yyyy (not trained)", false,
       [](tf::Date d) { return two(d.day) + "." + two(d.month) + "." + std::to_string(d.year); }},
      {"d/m/yyyy (not trained)", false, [](tf::Date d) { return fmt::format("{}/{}/{}", d.day, d.month, d.year); }},
      {"Month dth yyyy, no comma (not trained)", false,
       [](tf::Date d) {
         std::string s = tf::format_date(d, F::MonthOrdinalDayYear);
         return s.erase(s.find(','), 1);
       }},
  };
  return v;
}

}  // namespace

std::vector<VariationResult> measure_variations(tf::Transformer<float>& model, const tf::Vocabulary& vocab,
                                                const std::vector<tf::DateExample>& examples, double unsure_below) {
  std::vector<VariationResult> results;
  for (const Variation& variation : variations()) {
    VariationResult r{variation.name, variation.write({2021, 3, 5}), variation.trained, 0, 0, 0, 0};
    std::vector<std::string> inputs;
    for (const tf::DateExample& e : examples) {
      const tf::Date d{std::stoi(e.target.substr(0, 4)), std::stoi(e.target.substr(5, 2)),
                       std::stoi(e.target.substr(8, 2))};
      inputs.push_back(tf::normalize_date_text(variation.write(d)));
    }
    const std::vector<tf::Translation> answers = tf::translate_with_confidence(model, vocab, inputs);
    for (std::size_t i = 0; i < examples.size(); ++i, ++r.total) {
      if (!translation_doubt(inputs[i], answers[i], unsure_below).empty()) ++r.unsure;
      else if (answers[i].text == examples[i].target) ++r.right;
      else ++r.confidently_wrong;
    }
    results.push_back(std::move(r));
  }
  return results;
}

std::vector<OutsideAnswer> answers_outside_the_range(tf::Transformer<float>& model, const tf::Vocabulary& vocab,
                                                     double unsure_below) {
  const std::vector<std::string> inputs = {fmt::format("5 March {}", tf::kFirstYear - 1),
                                           fmt::format("5 March {}", tf::kLastYear + 1), "5 March 1492",
                                           "31 February 2021", "31/04/2021"};
  std::vector<std::string> normalized;
  for (const std::string& text : inputs) normalized.push_back(tf::normalize_date_text(text));
  const std::vector<tf::Translation> answers = tf::translate_with_confidence(model, vocab, normalized);
  std::vector<OutsideAnswer> out;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::string doubt = translation_doubt(normalized[i], answers[i], unsure_below);
    out.push_back({inputs[i], answer_line(answers[i].text, doubt), !doubt.empty()});
  }
  return out;
}

}  // namespace mha_cli
