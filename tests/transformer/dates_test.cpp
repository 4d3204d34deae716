// The date-normalisation task (examples/transformer/dates.hpp), checked against code written here
// independently of it: a calendar built by counting days forward from 1950-01-01 (a Sunday), and a
// regex parser per source format with its own month, weekday and ordinal tables. Every format must
// round-trip through that parser on every date; splits, the sampler and make_batch are checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "transformer/dates.hpp"
#include "transformer/vocabulary.hpp"

namespace transformer_test {
namespace {

using transformer::Batch;
using transformer::Date;
using transformer::DateExample;
using transformer::DateFormat;
using transformer::DateSampler;
using transformer::Split;
using transformer::Vocabulary;

// ---- the independent calendar -------------------------------------------------------------------

struct CalendarDay {
  Date date;
  int weekday;  // 0 = Monday .. 6 = Sunday
};

bool is_leap(int year) { return year % 400 == 0 || (year % 4 == 0 && year % 100 != 0); }

int month_length(int year, int month) {
  if (month == 2) return is_leap(year) ? 29 : 28;
  return (month == 4 || month == 6 || month == 9 || month == 11) ? 30 : 31;
}

// Every day of 1950..2049 in order, the weekday counted forward from Sunday 1950-01-01.
const std::vector<CalendarDay>& all_days() {
  static const std::vector<CalendarDay> days = [] {
    std::vector<CalendarDay> v;
    int weekday = 6;
    for (int y = 1950; y <= 2049; ++y)
      for (int m = 1; m <= 12; ++m)
        for (int d = 1; d <= month_length(y, m); ++d) {
          v.push_back({{y, m, d}, weekday});
          weekday = (weekday + 1) % 7;
        }
    return v;
  }();
  return days;
}

int weekday_of(Date date) {
  static const std::map<int, int> by_key = [] {
    std::map<int, int> m;
    for (const CalendarDay& c : all_days()) m[c.date.year * 10000 + c.date.month * 100 + c.date.day] = c.weekday;
    return m;
  }();
  const auto it = by_key.find(date.year * 10000 + date.month * 100 + date.day);
  if (it == by_key.end()) ADD_FAILURE() << "no such day";
  return it == by_key.end() ? -1 : it->second;
}

// "2021-03-05", digit by digit.
std::string iso_by_hand(Date d) {
  const auto digit = [](int n) { return static_cast<char>('0' + n); };
  return {digit(d.year / 1000),
          digit(d.year / 100 % 10),
          digit(d.year / 10 % 10),
          digit(d.year % 10),
          '-',
          digit(d.month / 10),
          digit(d.month % 10),
          '-',
          digit(d.day / 10),
          digit(d.day % 10)};
}

std::string describe(Date d) { return iso_by_hand(d); }

// ---- the independent parser ---------------------------------------------------------------------

const std::vector<std::string> kMonths = {"January", "February", "March",     "April",   "May",      "June",
                                          "July",    "August",   "September", "October", "November", "December"};
const std::vector<std::string> kMonthAbbreviations = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                                      "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
const std::vector<std::string> kWeekdays = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                            "Friday", "Saturday", "Sunday"};
const std::vector<std::string> kWeekdayAbbreviations = {"Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"};

// Day n in words, built from parts: "first" .. "ninth", the teens, "twenty-" + unit, "thirty-first".
std::string day_in_words(int n) {
  static const std::vector<std::string> units = {"",      "first", "second",  "third",  "fourth",
                                                 "fifth", "sixth", "seventh", "eighth", "ninth"};
  static const std::vector<std::string> ten_to_nineteen = {"tenth",      "eleventh",  "twelfth",   "thirteenth",
                                                           "fourteenth", "fifteenth", "sixteenth", "seventeenth",
                                                           "eighteenth", "nineteenth"};
  if (n < 10) return units[static_cast<std::size_t>(n)];
  if (n < 20) return ten_to_nineteen[static_cast<std::size_t>(n - 10)];
  const std::string tens = n < 30 ? "twent" : "thirt";
  return n % 10 == 0 ? tens + "ieth" : tens + "y-" + units[static_cast<std::size_t>(n % 10)];
}

// English ordinal suffixes: st for 1, 21, 31; nd for 2, 22; rd for 3, 23; th otherwise (incl. 11..13).
std::string ordinal_suffix(int n) {
  if (n == 1 || n == 21 || n == 31) return "st";
  if (n == 2 || n == 22) return "nd";
  if (n == 3 || n == 23) return "rd";
  return "th";
}

std::string to_upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](char c) { return c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c; });
  return s;
}

// 1-based position of `word` in `table`, or 0.
int index_in(const std::vector<std::string>& table, const std::string& word) {
  const auto it = std::find(table.begin(), table.end(), word);
  return it == table.end() ? 0 : static_cast<int>(it - table.begin()) + 1;
}

// What one regex group of a format holds.
enum class Field {
  Day,          // 1..31, no leading zero
  Day2,         // 01..31
  Suffix,       // the ordinal suffix of the Day before it
  DayWords,     // "fifth"
  Month2,       // 01..12
  Month,        // 1..12, no leading zero
  MonthName,    // "March"
  MonthAbbr,    // "Mar"
  MonthUpper,   // "MARCH"
  Year4,        // 2021
  Year2,        // 21: 50..99 -> 19xx, 00..49 -> 20xx
  Weekday,      // "Friday"
  WeekdayAbbr,  // "Fri"
};

struct Grammar {
  std::regex pattern;
  std::vector<Field> fields;  // one per capture group
};

const std::map<DateFormat, Grammar>& grammars() {
  using F = Field;
  static const std::map<DateFormat, Grammar> g = {
      {DateFormat::DayMonthYear, {std::regex(R"(([1-9]\d?) ([A-Z][a-z]+) (\d{4}))"), {F::Day, F::MonthName, F::Year4}}},
      {DateFormat::MonthOrdinalDayYear,
       {std::regex(R"(([A-Z][a-z]+) ([1-9]\d?)([a-z]{2}), (\d{4}))"), {F::MonthName, F::Day, F::Suffix, F::Year4}}},
      {DateFormat::MonthDayYear,
       {std::regex(R"(([A-Z][a-z]+) ([1-9]\d?), (\d{4}))"), {F::MonthName, F::Day, F::Year4}}},
      {DateFormat::ShortWeekdayDayMonYY,
       {std::regex(R"(([A-Z][a-z]{2}), ([1-9]\d?) ([A-Z][a-z]{2}) (\d{2}))"),
        {F::WeekdayAbbr, F::Day, F::MonthAbbr, F::Year2}}},
      {DateFormat::WeekdayDayMonthYear,
       {std::regex(R"(([A-Z][a-z]+), ([1-9]\d?) ([A-Z][a-z]+) (\d{4}))"),
        {F::Weekday, F::Day, F::MonthName, F::Year4}}},
      {DateFormat::WeekdayOrdinalDayMonthYear,
       {std::regex(R"(([A-Z][a-z]+) ([1-9]\d?)([a-z]{2}) ([A-Z][a-z]+) (\d{4}))"),
        {F::Weekday, F::Day, F::Suffix, F::MonthName, F::Year4}}},
      {DateFormat::OrdinalWordsOfMonthYear,
       {std::regex(R"(the ([a-z-]+) of ([A-Z][a-z]+) (\d{4}))"), {F::DayWords, F::MonthName, F::Year4}}},
      {DateFormat::DayMonDashYear,
       {std::regex(R"(([1-9]\d?)-([A-Z][a-z]{2})-(\d{4}))"), {F::Day, F::MonthAbbr, F::Year4}}},
      {DateFormat::SlashDMY, {std::regex(R"((\d{2})/(\d{2})/(\d{4}))"), {F::Day2, F::Month2, F::Year4}}},
      {DateFormat::ShortSlashDMY, {std::regex(R"(([1-9]\d?)/([1-9]\d?)/(\d{2}))"), {F::Day, F::Month, F::Year2}}},
      {DateFormat::DotDMYY, {std::regex(R"((\d{2})\.(\d{2})\.(\d{2}))"), {F::Day2, F::Month2, F::Year2}}},
      {DateFormat::DotYMD, {std::regex(R"((\d{4})\.(\d{2})\.(\d{2}))"), {F::Year4, F::Month2, F::Day2}}},
      {DateFormat::UpperDayMonthYear,
       {std::regex(R"(([1-9]\d?) ([A-Z]+) (\d{4}))"), {F::Day, F::MonthUpper, F::Year4}}},
      {DateFormat::IsoDashYMD, {std::regex(R"((\d{4})-(\d{2})-(\d{2}))"), {F::Year4, F::Month2, F::Day2}}},
      {DateFormat::IsoSlashYMD, {std::regex(R"((\d{4})/(\d{2})/(\d{2}))"), {F::Year4, F::Month2, F::Day2}}},
      {DateFormat::CompactYMD, {std::regex(R"((\d{4})(\d{2})(\d{2}))"), {F::Year4, F::Month2, F::Day2}}},
      {DateFormat::ShortDotDMY, {std::regex(R"(([1-9]\d?)\.([1-9]\d?)\.(\d{4}))"), {F::Day, F::Month, F::Year4}}},
      {DateFormat::MonPaddedDayYear,
       {std::regex(R"(([A-Z][a-z]{2}) (\d{2}) (\d{4}))"), {F::MonthAbbr, F::Day2, F::Year4}}},

  };
  return g;
}

struct Parsed {
  Date date{0, 0, 0};
  int weekday = -1;  // -1 when the format names no weekday
};

// Interprets one capture group; false when it is not a valid value of its field.
bool read_field(Field f, const std::string& s, Parsed& p) {
  std::vector<std::string> upper_months;
  switch (f) {
    case Field::Day:
    case Field::Day2:
    case Field::Month:
    case Field::Month2:
    case Field::Year4: {
      const int n = std::stoi(s);
      if (f == Field::Year4) p.date.year = n;
      else if (f == Field::Month || f == Field::Month2) p.date.month = n;
      else p.date.day = n;
      return true;
    }
    case Field::Suffix: return p.date.day > 0 && s == ordinal_suffix(p.date.day);
    case Field::DayWords:
      for (int d = 1; d <= 31; ++d)
        if (day_in_words(d) == s) p.date.day = d;
      return p.date.day > 0;
    case Field::MonthName: return (p.date.month = index_in(kMonths, s)) > 0;
    case Field::MonthAbbr: return (p.date.month = index_in(kMonthAbbreviations, s)) > 0;
    case Field::MonthUpper:
      for (const std::string& m : kMonths) upper_months.push_back(to_upper(m));
      return (p.date.month = index_in(upper_months, s)) > 0;

    case Field::Year2: {
      const int yy = std::stoi(s);
      p.date.year = yy >= 50 ? 1900 + yy : 2000 + yy;
      return true;
    }
    case Field::Weekday: return (p.weekday = index_in(kWeekdays, s) - 1) >= 0;
    case Field::WeekdayAbbr: return (p.weekday = index_in(kWeekdayAbbreviations, s) - 1) >= 0;
  }
  return false;
}

// The date (and weekday, if named) written in `source`, or nullopt if `source` is not in format `f`
// or names no real date.
std::optional<Parsed> parse(const std::string& source, DateFormat f) {
  const Grammar& g = grammars().at(f);
  std::smatch m;
  if (!std::regex_match(source, m, g.pattern) || m.size() != g.fields.size() + 1) return std::nullopt;
  Parsed p;
  for (std::size_t i = 0; i < g.fields.size(); ++i)
    if (!read_field(g.fields[i], m[i + 1].str(), p)) return std::nullopt;
  const Date& d = p.date;
  if (d.month < 1 || d.month > 12 || d.day < 1 || d.day > month_length(d.year, d.month)) return std::nullopt;
  return p;
}

// Checks one source string against the date it should spell; the failure message names both.
void expect_source_spells(const std::string& source, DateFormat f, const CalendarDay& day, const Vocabulary& vocab) {
  const std::optional<Parsed> p = parse(source, f);
  ASSERT_TRUE(p.has_value()) << "\"" << source << "\" (" << transformer::format_name(f) << ") does not parse; date "
                             << describe(day.date);
  EXPECT_EQ(p->date, day.date) << "\"" << source << "\" parses as " << describe(p->date) << ", not "
                               << describe(day.date);
  if (p->weekday >= 0) {
    EXPECT_EQ(p->weekday, day.weekday) << "\"" << source << "\" names the wrong weekday";
  }
  EXPECT_LE(source.size(), 48u) << source;
  for (const char c : source) EXPECT_TRUE(vocab.contains(c)) << "'" << c << "' in \"" << source << "\"";
}

// ---- calendar ------------------------------------------------------------------------------------

TEST(Calendar, IndependentCalendarHitsKnownAnchors) {
  // Guards the test's own calendar: 36525 days (25 leap years, 2000 among them), ending on a Friday.
  ASSERT_EQ(all_days().size(), 36525u);
  EXPECT_EQ(weekday_of({1970, 1, 1}), 3);    // Thursday
  EXPECT_EQ(weekday_of({2000, 1, 1}), 5);    // Saturday
  EXPECT_EQ(weekday_of({2021, 3, 5}), 4);    // Friday
  EXPECT_EQ(weekday_of({2049, 12, 31}), 4);  // Friday
}

TEST(Calendar, KnownAnchorWeekdays) {
  EXPECT_EQ(transformer::day_of_week({2021, 3, 5}), 4);    // Friday
  EXPECT_EQ(transformer::day_of_week({2000, 1, 1}), 5);    // Saturday
  EXPECT_EQ(transformer::day_of_week({1950, 1, 1}), 6);    // Sunday
  EXPECT_EQ(transformer::day_of_week({2049, 12, 31}), 4);  // Friday
  EXPECT_EQ(transformer::day_of_week({1969, 7, 20}), 6);   // Sunday (Apollo 11 landing)
  EXPECT_EQ(transformer::day_of_week({2000, 2, 29}), 1);   // Tuesday
}

TEST(Calendar, EveryDateMatchesIndependentCalendar) {
  for (const CalendarDay& c : all_days()) {
    ASSERT_TRUE(transformer::is_valid_date(c.date)) << describe(c.date);
    ASSERT_EQ(transformer::iso_date(c.date), iso_by_hand(c.date));
    ASSERT_EQ(transformer::day_of_week(c.date), c.weekday) << describe(c.date);
    ASSERT_EQ(transformer::days_in_month(c.date.year, c.date.month), month_length(c.date.year, c.date.month));
  }
}

TEST(Calendar, RejectsImpossibleAndOutOfRangeDates) {
  for (const Date d : {Date{2021, 2, 29}, Date{2021, 4, 31}, Date{2021, 13, 1}, Date{2021, 0, 10}, Date{2021, 1, 0},
                       Date{1949, 12, 31}, Date{2050, 1, 1}}) {
    EXPECT_FALSE(transformer::is_valid_date(d)) << d.year << "-" << d.month << "-" << d.day;
    EXPECT_THROW(transformer::iso_date(d), std::invalid_argument);
    EXPECT_THROW(transformer::day_of_week(d), std::invalid_argument);
    EXPECT_THROW(transformer::format_date(d, DateFormat::DayMonthYear), std::invalid_argument);
    EXPECT_THROW(transformer::date_in_split(d, Split::Train), std::invalid_argument);
  }
  EXPECT_TRUE(transformer::is_valid_date({2000, 2, 29}));
  EXPECT_TRUE(transformer::is_valid_date({2048, 2, 29}));
}

// ---- formats -------------------------------------------------------------------------------------

TEST(DateFormats, IssueExamplesFor2021_03_05) {
  const Date d{2021, 3, 5};
  const auto f = [&](DateFormat format) { return transformer::format_date(d, format); };
  EXPECT_EQ(f(DateFormat::DayMonthYear), "5 March 2021");
  EXPECT_EQ(f(DateFormat::MonthOrdinalDayYear), "March 5th, 2021");
  EXPECT_EQ(f(DateFormat::ShortWeekdayDayMonYY), "Fri, 5 Mar 21");
  EXPECT_EQ(f(DateFormat::SlashDMY), "05/03/2021");
  EXPECT_EQ(f(DateFormat::DotYMD), "2021.03.05");
  EXPECT_EQ(f(DateFormat::OrdinalWordsOfMonthYear), "the fifth of March 2021");
  EXPECT_EQ(f(DateFormat::IsoDashYMD), "2021-03-05");
  EXPECT_EQ(f(DateFormat::IsoSlashYMD), "2021/03/05");
  EXPECT_EQ(f(DateFormat::CompactYMD), "20210305");
  EXPECT_EQ(f(DateFormat::ShortDotDMY), "5.3.2021");
  EXPECT_EQ(f(DateFormat::MonPaddedDayYear), "Mar 05 2021");
  EXPECT_EQ(f(DateFormat::WeekdayDayMonthYear), "Friday, 5 March 2021");
  EXPECT_EQ(f(DateFormat::MonthDayYear), "March 5, 2021");
  EXPECT_EQ(f(DateFormat::DayMonDashYear), "5-Mar-2021");
  EXPECT_EQ(f(DateFormat::WeekdayOrdinalDayMonthYear), "Friday 5th March 2021");
  EXPECT_EQ(f(DateFormat::DotDMYY), "05.03.21");
  EXPECT_EQ(f(DateFormat::ShortSlashDMY), "5/3/21");
  EXPECT_EQ(f(DateFormat::UpperDayMonthYear), "5 MARCH 2021");
  EXPECT_EQ(transformer::iso_date(d), "2021-03-05");
}

TEST(DateFormats, AtLeastEightDistinctFormatsWithDistinctNames) {
  const auto formats = transformer::all_date_formats();
  EXPECT_GE(formats.size(), 8u);
  std::set<std::string> names, sources;
  for (const DateFormat f : formats) {
    EXPECT_FALSE(transformer::format_name(f).empty());
    names.insert(transformer::format_name(f));
    sources.insert(transformer::format_date({2021, 3, 5}, f));
    EXPECT_TRUE(grammars().count(f)) << "the test has no parser for " << transformer::format_name(f);
  }
  EXPECT_EQ(names.size(), formats.size());
  EXPECT_EQ(sources.size(), formats.size());
}

TEST(DateFormats, OrdinalSuffixes) {
  const auto f = [](int day) { return transformer::format_date({2021, 1, day}, DateFormat::MonthOrdinalDayYear); };
  EXPECT_EQ(f(1), "January 1st, 2021");
  EXPECT_EQ(f(2), "January 2nd, 2021");
  EXPECT_EQ(f(3), "January 3rd, 2021");
  EXPECT_EQ(f(4), "January 4th, 2021");
  EXPECT_EQ(f(11), "January 11th, 2021");
  EXPECT_EQ(f(12), "January 12th, 2021");
  EXPECT_EQ(f(13), "January 13th, 2021");
  EXPECT_EQ(f(21), "January 21st, 2021");
  EXPECT_EQ(f(22), "January 22nd, 2021");
  EXPECT_EQ(f(23), "January 23rd, 2021");
  EXPECT_EQ(f(31), "January 31st, 2021");
}

TEST(DateFormats, OrdinalWords) {
  const auto f = [](int day) { return transformer::format_date({2021, 1, day}, DateFormat::OrdinalWordsOfMonthYear); };
  EXPECT_EQ(f(1), "the first of January 2021");
  EXPECT_EQ(f(2), "the second of January 2021");
  EXPECT_EQ(f(3), "the third of January 2021");
  EXPECT_EQ(f(8), "the eighth of January 2021");
  EXPECT_EQ(f(9), "the ninth of January 2021");
  EXPECT_EQ(f(12), "the twelfth of January 2021");
  EXPECT_EQ(f(20), "the twentieth of January 2021");
  EXPECT_EQ(f(22), "the twenty-second of January 2021");
  EXPECT_EQ(f(30), "the thirtieth of January 2021");
  EXPECT_EQ(f(31), "the thirty-first of January 2021");
}

TEST(DateFormats, TwoDigitYearsSplitAtFifty) {
  const auto f = [](int year) { return transformer::format_date({year, 1, 2}, DateFormat::DotDMYY); };
  EXPECT_EQ(f(1950), "02.01.50");
  EXPECT_EQ(f(1999), "02.01.99");
  EXPECT_EQ(f(2000), "02.01.00");
  EXPECT_EQ(f(2009), "02.01.09");
  EXPECT_EQ(f(2049), "02.01.49");
}

// Each date in one format (cycling through them), and every 7th date in all formats: the source
// parses back to the date, names its real weekday, fits in 48 characters and the vocabulary.
TEST(DateFormats, EverySourceParsesBackToItsDate) {
  const Vocabulary vocab;
  const auto formats = transformer::all_date_formats();
  const std::vector<CalendarDay>& days = all_days();
  for (std::size_t i = 0; i < days.size(); ++i) {
    for (std::size_t k = 0; k < formats.size(); ++k) {
      if (i % 7 != 0 && k != i % formats.size()) continue;
      const std::string source = transformer::format_date(days[i].date, formats[k]);
      expect_source_spells(source, formats[k], days[i], vocab);
      if (HasFatalFailure() || HasNonfatalFailure()) return;  // one clear failure, not thousands
    }
  }
}

// The parser itself rejects what it should, so that the round trip above can fail.
TEST(DateFormats, TestParserRejectsWrongSources) {
  EXPECT_FALSE(parse("5 Marhc 2021", DateFormat::DayMonthYear));
  EXPECT_FALSE(parse("March 5rd, 2021", DateFormat::MonthOrdinalDayYear));
  EXPECT_FALSE(parse("March 11st, 2021", DateFormat::MonthOrdinalDayYear));
  EXPECT_FALSE(parse("31/04/2021", DateFormat::SlashDMY));
  EXPECT_FALSE(parse("5/3/2021", DateFormat::SlashDMY));
  EXPECT_FALSE(parse("the fivth of March 2021", DateFormat::OrdinalWordsOfMonthYear));
  EXPECT_FALSE(parse("5 March 2021", DateFormat::UpperDayMonthYear));
  const std::optional<Parsed> p = parse("Thu, 5 Mar 21", DateFormat::ShortWeekdayDayMonYY);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->date, (Date{2021, 3, 5}));
  EXPECT_NE(p->weekday, weekday_of({2021, 3, 5}));
  const std::optional<Parsed> dmy = parse("05/03/2021", DateFormat::SlashDMY);
  ASSERT_TRUE(dmy);
  EXPECT_EQ(dmy->date, (Date{2021, 3, 5}));  // day first
  const std::optional<Parsed> y2 = parse("01.01.50", DateFormat::DotDMYY);
  ASSERT_TRUE(y2);
  EXPECT_EQ(y2->date.year, 1950);
}

// ---- splits --------------------------------------------------------------------------------------

TEST(Splits, DisjointAndCovering) {
  for (const CalendarDay& c : all_days())
    ASSERT_NE(transformer::date_in_split(c.date, Split::Train), transformer::date_in_split(c.date, Split::HeldOut))
        << describe(c.date);
}

TEST(Splits, HeldOutIsAboutTenPercentOverallAndPerDecade) {
  std::map<int, int> held_out, total;  // by decade
  int all_held_out = 0;
  for (const CalendarDay& c : all_days()) {
    const bool h = transformer::date_in_split(c.date, Split::HeldOut);
    all_held_out += h;
    held_out[c.date.year / 10] += h;
    ++total[c.date.year / 10];
  }
  const double fraction = static_cast<double>(all_held_out) / static_cast<double>(all_days().size());
  EXPECT_NEAR(fraction, 0.10, 0.015);
  for (const auto& [decade, n] : total)
    EXPECT_NEAR(static_cast<double>(held_out[decade]) / n, 0.10, 0.04) << decade << "0s";
}

// ---- sampler -------------------------------------------------------------------------------------

bool same_examples(const std::vector<DateExample>& a, const std::vector<DateExample>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].source != b[i].source || a[i].target != b[i].target || a[i].format != b[i].format) return false;
  return true;
}

// Each sampled example is a correct pair of its split: the source parses to a date of the split, in
// the stated format, and the target is that date's ISO form.
TEST(DateSampler, ExamplesAreCorrectAndInTheirSplit) {
  const Vocabulary vocab;
  for (const Split split : {Split::Train, Split::HeldOut}) {
    for (const DateExample& e : transformer::sample_dates(split, 7, 3000)) {
      const std::optional<Parsed> p = parse(e.source, e.format);
      ASSERT_TRUE(p) << e.source;
      EXPECT_EQ(e.target, iso_by_hand(p->date)) << e.source;
      ASSERT_TRUE(transformer::date_in_split(p->date, split)) << e.source;
      ASSERT_FALSE(transformer::date_in_split(p->date, split == Split::Train ? Split::HeldOut : Split::Train));
      expect_source_spells(e.source, e.format, {p->date, weekday_of(p->date)}, vocab);
    }
  }
}

TEST(DateSampler, SameSeedSameStreamDifferentSeedsDiffer) {
  const auto a = transformer::sample_dates(Split::Train, 42, 200);
  EXPECT_TRUE(same_examples(a, transformer::sample_dates(Split::Train, 42, 200)));
  EXPECT_FALSE(same_examples(a, transformer::sample_dates(Split::Train, 43, 200)));
  EXPECT_FALSE(same_examples(a, transformer::sample_dates(Split::HeldOut, 42, 200)));
  EXPECT_FALSE(same_examples(transformer::sample_dates(Split::HeldOut, 1, 200),
                             transformer::sample_dates(Split::HeldOut, 2, 200)));

  // sample_dates is the sampler's first `count` examples, and a prefix of a longer run.
  DateSampler sampler(Split::Train, 42);
  std::vector<DateExample> by_hand;
  for (int i = 0; i < 200; ++i) by_hand.push_back(sampler.next());
  EXPECT_TRUE(same_examples(a, by_hand));
  const auto longer = transformer::sample_dates(Split::Train, 42, 300);
  EXPECT_TRUE(same_examples(a, {longer.begin(), longer.begin() + 200}));
}

// Formats uniform; dates spread over all decades and months. 13000 draws: each format expects 1000
// (binomial sd about 30), each month about 1083, each decade 1300.
TEST(DateSampler, FormatsAndDatesRoughlyUniform) {
  const auto formats = transformer::all_date_formats();
  const std::size_t n = 1000 * formats.size();
  for (const Split split : {Split::Train, Split::HeldOut}) {
    std::map<DateFormat, int> by_format;
    std::map<int, int> by_month, by_decade;
    std::set<std::string> distinct;
    for (const DateExample& e : transformer::sample_dates(split, 11, n)) {
      const std::optional<Parsed> p = parse(e.source, e.format);
      ASSERT_TRUE(p) << e.source;
      ++by_format[e.format];
      ++by_month[p->date.month];
      ++by_decade[p->date.year / 10];
      distinct.insert(e.target);
    }
    const double expected_month = static_cast<double>(n) / 12, expected_decade = static_cast<double>(n) / 10;
    for (const DateFormat f : formats) EXPECT_NEAR(by_format[f], 1000, 150) << transformer::format_name(f);
    for (int m = 1; m <= 12; ++m) EXPECT_NEAR(by_month[m], expected_month, 0.2 * expected_month) << "month " << m;
    for (int d = 195; d <= 204; ++d) EXPECT_NEAR(by_decade[d], expected_decade, 0.2 * expected_decade) << d << "0s";
    // The held-out split has about 3650 dates; 13000 uniform draws reach about 97% of them.
    EXPECT_GT(distinct.size(), split == Split::Train ? 9000u : 3000u);
  }
}

// ---- batches -------------------------------------------------------------------------------------

TEST(MakeBatch, ShapesPaddingBosAndEos) {
  const Vocabulary vocab;
  const std::vector<DateExample> examples = {
      {"5 March 2021", "2021-03-05", DateFormat::DayMonthYear},
      {"the thirty-first of December 1999", "1999-12-31", DateFormat::OrdinalWordsOfMonthYear},
      {"5/3/21", "2021-03-05", DateFormat::ShortSlashDMY},
  };
  const Batch b = transformer::make_batch(examples, vocab);
  const std::int64_t B = 3, S = 33, T = 11;  // S: the second source's length
  ASSERT_EQ(b.batch, B);
  ASSERT_EQ(b.source_len, S);
  ASSERT_EQ(b.target_len, T);
  ASSERT_EQ(b.source.size(), static_cast<std::size_t>(B * S));
  ASSERT_EQ(b.target_in.size(), static_cast<std::size_t>(B * T));
  ASSERT_EQ(b.target_out.size(), static_cast<std::size_t>(B * T));
  EXPECT_EQ(b.source_lengths, (std::vector<std::int64_t>{12, 33, 6}));
  for (std::int64_t i = 0; i < B; ++i) {
    const DateExample& e = examples[static_cast<std::size_t>(i)];
    const std::vector<int> src = vocab.encode(e.source), tgt = vocab.encode(e.target);
    for (std::int64_t s = 0; s < S; ++s) {
      const int expected = s < b.source_lengths[i] ? src[static_cast<std::size_t>(s)] : Vocabulary::kPad;
      EXPECT_EQ(b.source[i * S + s], expected) << "example " << i << " position " << s;
    }
    EXPECT_EQ(b.target_in[i * T], Vocabulary::kBos);
    EXPECT_EQ(b.target_out[i * T + T - 1], Vocabulary::kEos);
    for (std::int64_t t = 0; t < 10; ++t) {
      EXPECT_EQ(b.target_in[i * T + t + 1], tgt[static_cast<std::size_t>(t)]);
      EXPECT_EQ(b.target_out[i * T + t], tgt[static_cast<std::size_t>(t)]);
    }
    // Decoding gives the strings back (decode skips <bos>/<pad> and stops at <eos>).
    const auto row = [&](const std::vector<int>& v, std::int64_t len) {
      return std::vector<int>(v.begin() + i * len, v.begin() + (i + 1) * len);
    };
    EXPECT_EQ(vocab.decode(row(b.source, S)), e.source);
    EXPECT_EQ(vocab.decode(row(b.target_in, T)), e.target);
    EXPECT_EQ(vocab.decode(row(b.target_out, T)), e.target);
  }
}

TEST(MakeBatch, SampledBatchHasLongestSourceAsWidth) {
  const Vocabulary vocab;
  const auto examples = transformer::sample_dates(Split::Train, 5, 64);
  const Batch b = transformer::make_batch(examples, vocab);
  std::size_t longest = 0;
  for (const DateExample& e : examples) longest = std::max(longest, e.source.size());
  EXPECT_EQ(b.batch, 64);
  EXPECT_EQ(b.source_len, static_cast<std::int64_t>(longest));
  EXPECT_EQ(b.target_len, 11);
  for (std::size_t i = 0; i < examples.size(); ++i)
    EXPECT_EQ(b.source_lengths[i], static_cast<std::int64_t>(examples[i].source.size()));
}

TEST(MakeBatch, EmptyBatch) {
  const Batch b = transformer::make_batch({}, Vocabulary());
  EXPECT_EQ(b.batch, 0);
  EXPECT_EQ(b.source_len, 0);
  EXPECT_EQ(b.target_len, 11);
  EXPECT_TRUE(b.source.empty() && b.source_lengths.empty() && b.target_in.empty() && b.target_out.empty());
}

TEST(MakeBatch, RejectsBadExamplesNamingThem) {
  const Vocabulary vocab;
  const DateExample good{"5 March 2021", "2021-03-05", DateFormat::DayMonthYear};
  const std::vector<DateExample> short_target = {good, {"5 March 2021", "2021-3-5", DateFormat::DayMonthYear}};
  const std::vector<DateExample> bad_char = {good, good, {"5 March 2021!", "2021-03-05", DateFormat::DayMonthYear}};
  EXPECT_THROW(transformer::make_batch(short_target, vocab), std::invalid_argument);
  try {
    transformer::make_batch(bad_char, vocab);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("example 2"), std::string::npos) << m;
    EXPECT_NE(m.find("'!'"), std::string::npos) << m;
    EXPECT_NE(m.find("position 12"), std::string::npos) << m;
  }
}

// What `mha translate` feeds the model: the text as the trained formats write it.
TEST(NormalizeDateText, SpacingTrailingPunctuationAndNameCase) {
  using transformer::normalize_date_text;
  EXPECT_EQ(normalize_date_text("  5   march\t2021.  "), "5 March 2021");
  EXPECT_EQ(normalize_date_text("FRI, 5 MAR 21"), "Fri, 5 Mar 21");
  EXPECT_EQ(normalize_date_text("friday 5th MARCH 2021,"), "Friday 5th March 2021");
  EXPECT_EQ(normalize_date_text("the fifth of march 2021"), "the fifth of March 2021");
  EXPECT_EQ(normalize_date_text("may 5, 2021"), "May 5, 2021");
  EXPECT_EQ(normalize_date_text("05.03.21."), "05.03.21");
  EXPECT_EQ(normalize_date_text("hello world"), "hello world");  // not a name: left as it is
  EXPECT_EQ(normalize_date_text(" . "), "");
  // Every trained source is already normal.
  for (const DateFormat f : transformer::all_date_formats())
    for (const transformer::Date d : {transformer::Date{2021, 3, 5}, transformer::Date{1950, 12, 31}}) {
      const std::string source = transformer::format_date(d, f);
      if (f == DateFormat::UpperDayMonthYear) continue;  // "MARCH" is read as "March"
      EXPECT_EQ(normalize_date_text(source), source) << source;
    }
}

}  // namespace
}  // namespace transformer_test
