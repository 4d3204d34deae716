// The date-normalisation task: calendar arithmetic, the source formats, the split by calendar date,
// the SplitMix64 example sampler and padded batches (see dates.hpp for the conventions).
#include "transformer/dates.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "splitmix64.hpp"

namespace transformer {

namespace {

constexpr std::array<std::string_view, 12> kMonthNames = {"January",   "February", "March",    "April",
                                                          "May",       "June",     "July",     "August",
                                                          "September", "October",  "November", "December"};

// Monday first, as day_of_week counts.
constexpr std::array<std::string_view, 7> kWeekdayNames = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                                           "Friday", "Saturday", "Sunday"};

// kOrdinalWords[d - 1] is day d in words.
constexpr std::array<std::string_view, 31> kOrdinalWords = {
    "first",         "second",       "third",         "fourth",       "fifth",        "sixth",          "seventh",
    "eighth",        "ninth",        "tenth",         "eleventh",     "twelfth",      "thirteenth",     "fourteenth",
    "fifteenth",     "sixteenth",    "seventeenth",   "eighteenth",   "nineteenth",   "twentieth",      "twenty-first",
    "twenty-second", "twenty-third", "twenty-fourth", "twenty-fifth", "twenty-sixth", "twenty-seventh", "twenty-eighth",
    "twenty-ninth",  "thirtieth",    "thirty-first"};

constexpr std::array<DateFormat, 18> kAllFormats = {DateFormat::DayMonthYear,
                                                    DateFormat::MonthOrdinalDayYear,
                                                    DateFormat::MonthDayYear,
                                                    DateFormat::ShortWeekdayDayMonYY,
                                                    DateFormat::WeekdayDayMonthYear,
                                                    DateFormat::WeekdayOrdinalDayMonthYear,
                                                    DateFormat::OrdinalWordsOfMonthYear,
                                                    DateFormat::DayMonDashYear,
                                                    DateFormat::SlashDMY,
                                                    DateFormat::ShortSlashDMY,
                                                    DateFormat::DotDMYY,
                                                    DateFormat::DotYMD,
                                                    DateFormat::UpperDayMonthYear,
                                                    DateFormat::IsoDashYMD,
                                                    DateFormat::IsoSlashYMD,
                                                    DateFormat::CompactYMD,
                                                    DateFormat::ShortDotDMY,
                                                    DateFormat::MonPaddedDayYear};
static_assert(static_cast<std::size_t>(DateFormat::MonPaddedDayYear) + 1 == kAllFormats.size(),
              "kAllFormats lists every DateFormat");

// The target length, T = 10 ISO characters + 1 (<bos> in front of the decoder input, <eos> after the output).
constexpr std::int64_t kTargetLen = static_cast<std::int64_t>(kIsoLength) + 1;

void check_date(Date d) {
  if (!is_valid_date(d))
    throw std::invalid_argument("not a date of " + std::to_string(kFirstYear) + ".." + std::to_string(kLastYear) +
                                ": year " + std::to_string(d.year) + ", month " + std::to_string(d.month) + ", day " +
                                std::to_string(d.day));
}

// Days since 1970-01-01 (negative before), H. Hinnant's days_from_civil: counts from 0000-03-01 so
// that the leap day ends the year.
std::int64_t days_from_civil(Date d) {
  const std::int64_t y = d.year - (d.month <= 2 ? 1 : 0);
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const std::int64_t year_of_era = y - era * 400;                                     // [0, 399]
  const std::int64_t day_of_year = (153 * ((d.month + 9) % 12) + 2) / 5 + d.day - 1;  // [0, 365]
  const std::int64_t day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
  return era * 146097 + day_of_era - 719468;
}

std::string two_digits(int n) {
  char buffer[8];
  std::snprintf(buffer, sizeof buffer, "%02d", n);
  return buffer;
}

std::string month_name(Date d) { return std::string(kMonthNames[static_cast<std::size_t>(d.month - 1)]); }
std::string month_abbreviation(Date d) { return month_name(d).substr(0, 3); }
std::string weekday_name(Date d) { return std::string(kWeekdayNames[static_cast<std::size_t>(day_of_week(d))]); }
std::string weekday_abbreviation(Date d) { return weekday_name(d).substr(0, 3); }
std::string ordinal_words(int day) { return std::string(kOrdinalWords[static_cast<std::size_t>(day - 1)]); }

// What follows n in "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st".
const char* ordinal_suffix(int n) {
  const bool teen = n % 100 >= 11 && n % 100 <= 13;
  const int last = n % 10;
  return teen ? "th" : last == 1 ? "st" : last == 2 ? "nd" : last == 3 ? "rd" : "th";
}

std::string upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return s;
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

// Builds a source string piece by piece, noting the span each field lands on.
class SourceWriter {
 public:
  SourceWriter& text(std::string_view s) {
    out_.text += s;
    return *this;
  }
  SourceWriter& year(std::string_view s) { return field(out_.fields.year, s); }
  SourceWriter& month(std::string_view s) { return field(out_.fields.month, s); }
  SourceWriter& day(std::string_view s) { return field(out_.fields.day, s); }
  FormattedDate done() { return std::move(out_); }

 private:
  SourceWriter& field(CharSpan& span, std::string_view s) {
    span = {out_.text.size(), out_.text.size() + s.size()};
    out_.text += s;
    return *this;
  }
  FormattedDate out_;
};

std::vector<Date> dates_of_split(Split split) {
  std::vector<Date> dates;
  for (int year = kFirstYear; year <= kLastYear; ++year)
    for (int month = 1; month <= 12; ++month)
      for (int day = 1; day <= days_in_month(year, month); ++day)
        if (date_in_split({year, month, day}, split)) dates.push_back({year, month, day});
  return dates;
}

// The ids of `text` with the example's index in the error message.
std::vector<int> encode_field(const Vocabulary& vocab, std::string_view text, std::size_t example, const char* field) {
  try {
    return vocab.encode(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("make_batch: example " + std::to_string(example) + " " + field + ": " + e.what());
  }
}

// Row i of the batch: source ids then padding; target_in = <bos> y1 .. y10; target_out = y1 .. y10 <eos>.
void write_row(Batch& b, std::size_t i, const std::vector<int>& source, const std::vector<int>& target) {
  const auto S = static_cast<std::size_t>(b.source_len), T = static_cast<std::size_t>(b.target_len);
  b.source_lengths.push_back(static_cast<std::int64_t>(source.size()));
  std::copy(source.begin(), source.end(), b.source.begin() + static_cast<std::ptrdiff_t>(i * S));
  int* in_row = b.target_in.data() + i * T;
  int* out_row = b.target_out.data() + i * T;
  in_row[0] = Vocabulary::kBos;
  std::copy(target.begin(), target.end(), in_row + 1);
  std::copy(target.begin(), target.end(), out_row);
  out_row[T - 1] = Vocabulary::kEos;
}

}  // namespace

int days_in_month(int year, int month) {
  static constexpr std::array<int, 12> kDays = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
  return month == 2 && leap ? 29 : kDays[static_cast<std::size_t>(month - 1)];
}

bool is_valid_date(Date d) {
  return d.year >= kFirstYear && d.year <= kLastYear && d.month >= 1 && d.month <= 12 && d.day >= 1 &&
         d.day <= days_in_month(d.year, d.month);
}

std::string iso_date(Date d) {
  check_date(d);
  return std::to_string(d.year) + "-" + two_digits(d.month) + "-" + two_digits(d.day);
}

int day_of_week(Date d) {
  check_date(d);
  // 1970-01-01 was a Thursday (3 with Monday = 0).
  const std::int64_t days = days_from_civil(d);
  return static_cast<int>(((days % 7) + 7 + 3) % 7);
}

std::span<const DateFormat> all_date_formats() { return kAllFormats; }

std::string format_name(DateFormat f) {
  switch (f) {
    case DateFormat::DayMonthYear: return "d Month yyyy";
    case DateFormat::MonthOrdinalDayYear: return "Month dth, yyyy";
    case DateFormat::MonthDayYear: return "Month d, yyyy";
    case DateFormat::ShortWeekdayDayMonYY: return "Wkd, d Mon yy";
    case DateFormat::WeekdayDayMonthYear: return "Weekday, d Month yyyy";
    case DateFormat::WeekdayOrdinalDayMonthYear: return "Weekday dth Month yyyy";
    case DateFormat::OrdinalWordsOfMonthYear: return "the dth-in-words of Month yyyy";
    case DateFormat::DayMonDashYear: return "d-Mon-yyyy";
    case DateFormat::SlashDMY: return "dd/mm/yyyy";
    case DateFormat::ShortSlashDMY: return "d/m/yy";
    case DateFormat::DotDMYY: return "dd.mm.yy";
    case DateFormat::DotYMD: return "yyyy.mm.dd";
    case DateFormat::UpperDayMonthYear: return "d MONTH yyyy";
    case DateFormat::IsoDashYMD: return "yyyy-mm-dd";
    case DateFormat::IsoSlashYMD: return "yyyy/mm/dd";
    case DateFormat::CompactYMD: return "yyyymmdd";
    case DateFormat::ShortDotDMY: return "d.m.yyyy";
    case DateFormat::MonPaddedDayYear: return "Mon dd yyyy";
  }
  throw std::invalid_argument("format_name: unknown DateFormat " + std::to_string(static_cast<int>(f)));
}

std::string format_description(DateFormat f) {
  switch (f) {
    case DateFormat::DayMonthYear: return "day, month name, year";
    case DateFormat::MonthOrdinalDayYear: return "month name, day with st/nd/rd/th, comma, year";
    case DateFormat::MonthDayYear: return "month name, day, comma, year";
    case DateFormat::ShortWeekdayDayMonYY: return "weekday and month in three letters, two-digit year";
    case DateFormat::WeekdayDayMonthYear: return "weekday, comma, day, month name, year";
    case DateFormat::WeekdayOrdinalDayMonthYear: return "weekday, day with st/nd/rd/th, month name, year";
    case DateFormat::OrdinalWordsOfMonthYear: return "the day in words, \"of\", month name, year";
    case DateFormat::DayMonDashYear: return "day, month in three letters, year, with dashes";
    case DateFormat::SlashDMY: return "day/month/year with slashes, day first, day and month in two digits";
    case DateFormat::ShortSlashDMY: return "day/month/year with slashes, day first, no leading zeros, two-digit year";
    case DateFormat::DotDMYY: return "day.month.year with dots, day first, all in two digits";
    case DateFormat::DotYMD: return "year.month.day with dots, year first";
    case DateFormat::UpperDayMonthYear: return "day, month name in capitals, year";
    case DateFormat::IsoDashYMD: return "year-month-day with dashes (ISO 8601, the answer's own format)";
    case DateFormat::IsoSlashYMD: return "year/month/day with slashes, year first";
    case DateFormat::CompactYMD: return "year, month and day run together in eight digits";
    case DateFormat::ShortDotDMY: return "day.month.year with dots, day first, no leading zeros";
    case DateFormat::MonPaddedDayYear: return "month in three letters, day in two digits, year";
  }
  throw std::invalid_argument("format_description: unknown DateFormat " + std::to_string(static_cast<int>(f)));
}

std::string format_date(Date d, DateFormat f) { return format_date_fields(d, f).text; }

FormattedDate format_date_fields(Date d, DateFormat f) {
  check_date(d);
  const std::string day = std::to_string(d.day), month = std::to_string(d.month), year = std::to_string(d.year);
  const std::string dd = two_digits(d.day), mm = two_digits(d.month), yy = two_digits(d.year % 100);
  const std::string name = month_name(d), abbreviation = month_abbreviation(d), suffix = ordinal_suffix(d.day);
  SourceWriter w;
  switch (f) {
    case DateFormat::DayMonthYear: return w.day(day).text(" ").month(name).text(" ").year(year).done();
    case DateFormat::MonthOrdinalDayYear: return w.month(name).text(" ").day(day).text(suffix + ", ").year(year).done();
    case DateFormat::MonthDayYear: return w.month(name).text(" ").day(day).text(", ").year(year).done();
    case DateFormat::ShortWeekdayDayMonYY:
      return w.text(weekday_abbreviation(d) + ", ").day(day).text(" ").month(abbreviation).text(" ").year(yy).done();
    case DateFormat::WeekdayDayMonthYear:
      return w.text(weekday_name(d) + ", ").day(day).text(" ").month(name).text(" ").year(year).done();
    case DateFormat::WeekdayOrdinalDayMonthYear:
      return w.text(weekday_name(d) + " ").day(day).text(suffix + " ").month(name).text(" ").year(year).done();
    case DateFormat::OrdinalWordsOfMonthYear:
      return w.text("the ").day(ordinal_words(d.day)).text(" of ").month(name).text(" ").year(year).done();
    case DateFormat::DayMonDashYear: return w.day(day).text("-").month(abbreviation).text("-").year(year).done();
    case DateFormat::SlashDMY: return w.day(dd).text("/").month(mm).text("/").year(year).done();
    case DateFormat::ShortSlashDMY: return w.day(day).text("/").month(month).text("/").year(yy).done();
    case DateFormat::DotDMYY: return w.day(dd).text(".").month(mm).text(".").year(yy).done();
    case DateFormat::DotYMD: return w.year(year).text(".").month(mm).text(".").day(dd).done();
    case DateFormat::UpperDayMonthYear: return w.day(day).text(" ").month(upper(name)).text(" ").year(year).done();
    case DateFormat::IsoDashYMD: return w.year(year).text("-").month(mm).text("-").day(dd).done();
    case DateFormat::IsoSlashYMD: return w.year(year).text("/").month(mm).text("/").day(dd).done();
    case DateFormat::CompactYMD: return w.year(year).month(mm).day(dd).done();
    case DateFormat::ShortDotDMY: return w.day(day).text(".").month(month).text(".").year(year).done();
    case DateFormat::MonPaddedDayYear: return w.month(abbreviation).text(" ").day(dd).text(" ").year(year).done();
  }
  throw std::invalid_argument("format_date: unknown DateFormat " + std::to_string(static_cast<int>(f)));
}

std::string normalize_date_text(const std::string& text) {
  auto title_case = [](std::string word) {  // the name (or abbreviation) this word is, in any case, or ""
    const std::string folded = lower(word);
    auto matches = [&](std::string_view name) {
      const std::string n = lower(std::string(name));
      return folded == n || folded == n.substr(0, 3);
    };
    for (std::string_view name : kMonthNames)
      if (matches(name)) return folded.size() == 3 ? std::string(name.substr(0, 3)) : std::string(name);
    for (std::string_view name : kWeekdayNames)
      if (matches(name)) return folded.size() == 3 ? std::string(name.substr(0, 3)) : std::string(name);
    return word;
  };
  std::string out, word;
  auto flush_word = [&] {
    out += title_case(word);
    word.clear();
  };
  for (const char c : text) {
    if (c == ' ' || c == '\t') {
      flush_word();
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      word += c;
    } else {
      flush_word();
      out += c;
    }
  }
  flush_word();
  while (!out.empty() && (out.back() == ' ' || out.back() == '.' || out.back() == ',')) out.pop_back();
  return out;
}

bool date_in_split(Date d, Split s) {
  check_date(d);
  // A fixed salt keeps this hash apart from the sampler's stream; 100 of every 1000 hash values are
  // held out. Changing either changes which dates a trained model has seen.
  constexpr std::uint64_t kSplitSalt = 0x6461746573706c74ULL;  // "datesplt"
  const auto key = static_cast<std::uint64_t>(d.year * 10000 + d.month * 100 + d.day);
  const bool held_out = mha::detail::splitmix64_finalize(key ^ kSplitSalt) % 1000 < 100;
  return held_out == (s == Split::HeldOut);
}

DateSampler::DateSampler(Split split, std::uint64_t seed) : dates_(dates_of_split(split)), state_(seed) {}

std::uint64_t DateSampler::uniform_below(std::uint64_t n) {
  // Reject the lowest 2^64 mod n draws so that every residue is equally likely.
  const std::uint64_t threshold = (0 - n) % n;
  for (;;) {
    state_ += 0x9e3779b97f4a7c15ULL;  // SplitMix64's step
    const std::uint64_t r = mha::detail::splitmix64_finalize(state_);
    if (r >= threshold) return r % n;
  }
}

DateExample DateSampler::next() {
  const Date d = dates_[uniform_below(dates_.size())];
  const DateFormat f = kAllFormats[uniform_below(kAllFormats.size())];
  FormattedDate source = format_date_fields(d, f);
  return {std::move(source.text), iso_date(d), f, source.fields};
}

std::vector<DateExample> sample_dates(Split split, std::uint64_t seed, std::size_t count) {
  DateSampler sampler(split, seed);
  std::vector<DateExample> examples;
  examples.reserve(count);
  for (std::size_t i = 0; i < count; ++i) examples.push_back(sampler.next());
  return examples;
}

Batch make_batch(std::span<const DateExample> examples, const Vocabulary& vocab) {
  Batch b;
  b.batch = static_cast<std::int64_t>(examples.size());
  b.target_len = kTargetLen;
  for (const DateExample& e : examples)
    b.source_len = std::max(b.source_len, static_cast<std::int64_t>(e.source.size()));
  b.source.assign(static_cast<std::size_t>(b.batch * b.source_len), Vocabulary::kPad);
  b.target_in.assign(static_cast<std::size_t>(b.batch * b.target_len), Vocabulary::kPad);
  b.target_out.assign(static_cast<std::size_t>(b.batch * b.target_len), Vocabulary::kPad);
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const DateExample& e = examples[i];
    if (e.target.size() != kIsoLength)
      throw std::invalid_argument("make_batch: example " + std::to_string(i) + " target \"" + e.target + "\" has " +
                                  std::to_string(e.target.size()) + " characters, not " + std::to_string(kIsoLength));
    write_row(b, i, encode_field(vocab, e.source, i, "source"), encode_field(vocab, e.target, i, "target"));
  }
  return b;
}

}  // namespace transformer
