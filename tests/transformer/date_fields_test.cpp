// Where a source string writes its year, month and day (transformer::format_date_fields, what the demo
// boxes on its attention maps), checked by reading each span back with tables written here: for every
// format, the spans hold exactly the date's year, month and day, and what lies outside them is only
// punctuation, spaces, a weekday, "the", "of" or an ordinal suffix.
#include <gtest/gtest.h>

#include <cctype>
#include <optional>
#include <string>
#include <vector>

#include "transformer/dates.hpp"

namespace transformer_test {
namespace {

using transformer::CharSpan;
using transformer::Date;
using transformer::DateFormat;
using transformer::FormattedDate;

std::string lowercase(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

const std::vector<std::string> kMonths = {"january", "february", "march",     "april",   "may",      "june",
                                          "july",    "august",   "september", "october", "november", "december"};
const std::vector<std::string> kWeekdays = {"monday", "tuesday",  "wednesday", "thursday",
                                            "friday", "saturday", "sunday"};

// Day n (1..31) in words: "first" .. "ninth", "tenth" .. "nineteenth", "twentieth", "twenty-" + unit, ...
std::string day_word(int n) {
  static const std::vector<std::string> units = {"first", "second",  "third",  "fourth", "fifth",
                                                 "sixth", "seventh", "eighth", "ninth"};
  static const std::vector<std::string> teens = {"tenth",     "eleventh",  "twelfth",     "thirteenth", "fourteenth",
                                                 "fifteenth", "sixteenth", "seventeenth", "eighteenth", "nineteenth"};
  if (n < 10) return units[static_cast<std::size_t>(n - 1)];
  if (n < 20) return teens[static_cast<std::size_t>(n - 10)];
  const std::string tens = n < 30 ? "twent" : "thirt";
  return n % 10 == 0 ? tens + "ieth" : tens + "y-" + units[static_cast<std::size_t>(n % 10 - 1)];
}

// The month a span names: digits, or a month's name or first three letters in any case.
std::optional<int> read_month(const std::string& s) {
  if (all_digits(s) && s.size() <= 2) return std::stoi(s);
  for (std::size_t m = 0; m < kMonths.size(); ++m)
    if (lowercase(s) == kMonths[m] || lowercase(s) == kMonths[m].substr(0, 3)) return static_cast<int>(m) + 1;
  return std::nullopt;
}

std::optional<int> read_day(const std::string& s) {
  if (all_digits(s) && s.size() <= 2) return std::stoi(s);
  for (int d = 1; d <= 31; ++d)
    if (s == day_word(d)) return d;
  return std::nullopt;
}

// Four digits are the year; two are 50..99 -> 1950..1999, 00..49 -> 2000..2049.
std::optional<int> read_year(const std::string& s) {
  if (!all_digits(s)) return std::nullopt;
  if (s.size() == 4) return std::stoi(s);
  if (s.size() == 2) return std::stoi(s) >= 50 ? 1900 + std::stoi(s) : 2000 + std::stoi(s);
  return std::nullopt;
}

// A word that may lie outside the fields: a weekday (named or in three letters), "the", "of", or an
// ordinal suffix.
bool allowed_outside_fields(const std::string& word) {
  for (const std::string& w : kWeekdays)
    if (word == w || word == w.substr(0, 3)) return true;
  return word == "the" || word == "of" || word == "st" || word == "nd" || word == "rd" || word == "th";
}

std::string describe(Date d, DateFormat f, const std::string& text) {
  return "\"" + text + "\" (" + transformer::format_name(f) + ", " + std::to_string(d.year) + "-" +
         std::to_string(d.month) + "-" + std::to_string(d.day) + ")";
}

// Every check of one formatted date; false after the first failure.
bool expect_fields_hold_the_date(Date d, DateFormat f) {
  const FormattedDate fd = transformer::format_date_fields(d, f);
  const std::string what = describe(d, f, fd.text);
  EXPECT_EQ(fd.text, transformer::format_date(d, f)) << what;
  const CharSpan spans[] = {fd.fields.year, fd.fields.month, fd.fields.day};
  std::string outside = fd.text;  // the text with the fields blanked out
  for (const CharSpan& s : spans) {
    if (!(s.begin < s.end && s.end <= fd.text.size())) {
      ADD_FAILURE() << what << ": span [" << s.begin << ", " << s.end << ") is empty or past the end";
      return false;
    }
    for (std::size_t i = s.begin; i < s.end; ++i) {
      if (outside[i] == '\0') {
        ADD_FAILURE() << what << ": fields overlap at character " << i;
        return false;
      }
      outside[i] = '\0';
    }
  }
  auto text_of = [&](CharSpan s) { return fd.text.substr(s.begin, s.size()); };
  EXPECT_EQ(read_year(text_of(fd.fields.year)), d.year) << what << ": year span \"" << text_of(fd.fields.year) << "\"";
  EXPECT_EQ(read_month(text_of(fd.fields.month)), d.month)
      << what << ": month span \"" << text_of(fd.fields.month) << "\"";
  EXPECT_EQ(read_day(text_of(fd.fields.day)), d.day) << what << ": day span \"" << text_of(fd.fields.day) << "\"";
  // Outside the fields: no digit (each field's span holds all of its digits) and only allowed words.
  std::string word;
  for (std::size_t i = 0; i <= outside.size(); ++i) {
    const char c = i < outside.size() ? outside[i] : ' ';
    EXPECT_FALSE(std::isdigit(static_cast<unsigned char>(c))) << what << ": digit outside the fields at " << i;
    if (std::isalpha(static_cast<unsigned char>(c))) {
      word += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else {
      EXPECT_TRUE(word.empty() || allowed_outside_fields(word)) << what << ": \"" << word << "\" outside the fields";
      word.clear();
    }
  }
  return !::testing::Test::HasFailure();
}

bool is_leap(int y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; }
int month_days(int y, int m) {
  return m == 2 ? (is_leap(y) ? 29 : 28) : (m == 4 || m == 6 || m == 9 || m == 11) ? 30 : 31;
}

TEST(DateFields, EveryFormatsSpansReadBackAsItsDate) {
  // Every day of 1950..2049 in one format (cycling), and every 11th day in every format.
  const auto formats = transformer::all_date_formats();
  std::size_t n = 0;
  for (int y = 1950; y <= 2049; ++y)
    for (int m = 1; m <= 12; ++m)
      for (int d = 1; d <= month_days(y, m); ++d, ++n)
        for (std::size_t k = 0; k < formats.size(); ++k) {
          if (n % 11 != 0 && k != n % formats.size()) continue;
          if (!expect_fields_hold_the_date({y, m, d}, formats[k])) return;  // one clear failure, not thousands
        }
}

TEST(DateFields, HandPickedSpans) {
  auto spans = [](Date d, DateFormat f) {
    const FormattedDate fd = transformer::format_date_fields(d, f);
    auto at = [&](CharSpan s) { return fd.text.substr(s.begin, s.size()); };
    return std::vector<std::string>{at(fd.fields.year), at(fd.fields.month), at(fd.fields.day)};
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(spans({2021, 3, 5}, DateFormat::OrdinalWordsOfMonthYear), (V{"2021", "March", "fifth"}));
  EXPECT_EQ(spans({2021, 3, 22}, DateFormat::OrdinalWordsOfMonthYear), (V{"2021", "March", "twenty-second"}));
  EXPECT_EQ(spans({2021, 3, 5}, DateFormat::ShortWeekdayDayMonYY), (V{"21", "Mar", "5"}));
  EXPECT_EQ(spans({2021, 3, 23}, DateFormat::WeekdayOrdinalDayMonthYear), (V{"2021", "March", "23"}));
  EXPECT_EQ(spans({1999, 12, 31}, DateFormat::CompactYMD), (V{"1999", "12", "31"}));
  EXPECT_EQ(spans({2021, 3, 5}, DateFormat::UpperDayMonthYear), (V{"2021", "MARCH", "5"}));
  EXPECT_EQ(spans({2021, 3, 5}, DateFormat::SlashDMY), (V{"2021", "03", "05"}));
  const FormattedDate fd = transformer::format_date_fields({2021, 3, 5}, DateFormat::WeekdayDayMonthYear);
  EXPECT_EQ(fd.text, "Friday, 5 March 2021");
  EXPECT_EQ(fd.fields.day, (CharSpan{8, 9}));
  EXPECT_EQ(fd.fields.month, (CharSpan{10, 15}));
  EXPECT_EQ(fd.fields.year, (CharSpan{16, 20}));
}

TEST(DateFields, SampledExamplesCarryTheirSpans) {
  for (const transformer::DateExample& e : transformer::sample_dates(transformer::Split::HeldOut, 3, 500)) {
    const std::string year = e.source.substr(e.fields.year.begin, e.fields.year.size());
    const std::string month = e.source.substr(e.fields.month.begin, e.fields.month.size());
    const std::string day = e.source.substr(e.fields.day.begin, e.fields.day.size());
    // The target is yyyy-mm-dd.
    EXPECT_EQ(read_year(year), std::stoi(e.target.substr(0, 4))) << e.source;
    EXPECT_EQ(read_month(month), std::stoi(e.target.substr(5, 2))) << e.source;
    EXPECT_EQ(read_day(day), std::stoi(e.target.substr(8, 2))) << e.source;
  }
}

// The reading-back tables themselves tell fields apart, so that the checks above can fail.
TEST(DateFields, ReadBackRejectsWrongSpans) {
  EXPECT_EQ(read_month("Marc"), std::nullopt);
  EXPECT_EQ(read_day("fifth "), std::nullopt);
  EXPECT_EQ(read_year("021"), std::nullopt);
  EXPECT_EQ(read_day("twenty-second"), 22);
  EXPECT_EQ(read_day("thirtieth"), 30);
  EXPECT_EQ(read_year("49"), 2049);
  EXPECT_EQ(read_year("50"), 1950);
  EXPECT_FALSE(allowed_outside_fields("march"));
  EXPECT_FALSE(allowed_outside_fields("fifth"));
  EXPECT_TRUE(allowed_outside_fields("fri"));
}

}  // namespace
}  // namespace transformer_test
