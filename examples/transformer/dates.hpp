// The date-normalisation task: human-written dates ("Fri, 5 Mar 21", "the fifth of March 2021") ->
// ISO 8601 ("2021-03-05"). Calendar helpers, the source formats, the train / held-out split by
// calendar date, a deterministic example sampler and the padded batches the model consumes.
//
// Conventions of the source formats:
//   - numeric dates with slashes or dots are DAY-FIRST: "05/03/2021" and "05.03.21" are 5 March 2021
//     (the year-first numeric formats, "2021.03.05", "2021-03-05", "2021/03/05", "20210305", start
//     with the four-digit year);
//   - two-digit years are 50..99 -> 1950..1999 and 00..49 -> 2000..2049, so they cover exactly the
//     task's years;
//   - weekday names are the real weekday of the date;
//   - every source string is at most kMaxSourceLength characters, all in the Vocabulary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "transformer/vocabulary.hpp"

namespace transformer {

// A date of the proleptic Gregorian calendar, restricted to the task's years.
struct Date {
  int year, month, day;  // month 1..12, day 1..days_in_month
  friend bool operator==(const Date&, const Date&) = default;
};
constexpr int kFirstYear = 1950, kLastYear = 2049;
constexpr std::size_t kMaxSourceLength = 48;
constexpr std::size_t kIsoLength = 10;  // "yyyy-mm-dd"

// 28..31; leap years are those divisible by 4, except centuries not divisible by 400.
int days_in_month(int year, int month);
// A real calendar date with kFirstYear <= year <= kLastYear. The functions below throw
// std::invalid_argument for any other Date.
bool is_valid_date(Date d);

std::string iso_date(Date d);  // "2021-03-05"
int day_of_week(Date d);       // 0 = Monday .. 6 = Sunday

// The human-written formats; the comment shows 2021-03-05 (a Friday) in each.
enum class DateFormat {
  DayMonthYear,                // "5 March 2021"
  MonthOrdinalDayYear,         // "March 5th, 2021"
  MonthDayYear,                // "March 5, 2021"
  ShortWeekdayDayMonYY,        // "Fri, 5 Mar 21"
  WeekdayDayMonthYear,         // "Friday, 5 March 2021"
  WeekdayOrdinalDayMonthYear,  // "Friday 5th March 2021"
  OrdinalWordsOfMonthYear,     // "the fifth of March 2021"
  DayMonDashYear,              // "5-Mar-2021"
  SlashDMY,                    // "05/03/2021"   day-first
  ShortSlashDMY,               // "5/3/21"       day-first, no zero padding
  DotDMYY,                     // "05.03.21"     day-first
  DotYMD,                      // "2021.03.05"
  UpperDayMonthYear,           // "5 MARCH 2021"
  IsoDashYMD,                  // "2021-03-05"   the output format itself
  IsoSlashYMD,                 // "2021/03/05"
  CompactYMD,                  // "20210305"
  ShortDotDMY,                 // "5.3.2021"     day-first, no zero padding
  MonPaddedDayYear,            // "Mar 05 2021"
};
std::span<const DateFormat> all_date_formats();  // every DateFormat, in declaration order
std::string format_name(DateFormat f);           // shorthand, e.g. "d Month yyyy"
// The format in words, for readers who do not know the shorthand: e.g. "day/month/year with
// slashes, day first, day and month in two digits" (format_date({2021, 3, 5}, f) is its example).
std::string format_description(DateFormat f);
std::string format_date(Date d, DateFormat f);

// Characters [begin, end) of a source string.
struct CharSpan {
  std::size_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
  friend bool operator==(const CharSpan&, const CharSpan&) = default;
};
// Where a source string writes the year, the month and the day. The year is its four or two digits,
// the month its digits, name or three-letter abbreviation, the day its digits (without an ordinal
// suffix: the "5" of "5th") or its word ("fifth"). A weekday is no field: the date determines it.
struct DateFields {
  CharSpan year, month, day;
};
// A source string and where its fields are: format_date's text, written field by field.
struct FormattedDate {
  std::string text;
  DateFields fields;
};
FormattedDate format_date_fields(Date d, DateFormat f);

// `text` the way the formats write it, for a model trained on them: leading, trailing and repeated
// whitespace collapsed to single spaces, trailing periods and commas dropped, and month and weekday
// names and their three-letter abbreviations in any letter case written as the formats write them
// ("MARCH", "march" -> "March"; "mar" -> "Mar"). Other text is left as it is.
std::string normalize_date_text(const std::string& text);

struct DateExample {
  std::string source;  // the human-written date
  std::string target;  // its iso_date
  DateFormat format;
  DateFields fields{};  // where `source` writes the year, month and day (DateSampler fills them in)
};

// Train and held-out sets are drawn apart BY CALENDAR DATE: a fixed hash of (year, month, day) puts
// every date in exactly one split (held-out: about 10% of dates), so no held-out date is ever seen in
// training, in any format.
enum class Split { Train, HeldOut };
bool date_in_split(Date d, Split s);

// A deterministic stream of examples: the same (split, seed) gives the same examples on every
// platform (own SplitMix64 generator, no std:: distributions). Each example's date is uniform over
// the split's dates in kFirstYear..kLastYear, its format uniform over all_date_formats().
class DateSampler {
 public:
  DateSampler(Split split, std::uint64_t seed);
  DateExample next();

 private:
  std::uint64_t uniform_below(std::uint64_t n);  // uniform in [0, n), n > 0, no modulo bias

  std::vector<Date> dates_;  // the split's dates, in calendar order
  std::uint64_t state_;      // SplitMix64 state
};
// The first `count` examples of DateSampler(split, seed).
std::vector<DateExample> sample_dates(Split split, std::uint64_t seed, std::size_t count);

// A padded batch of encoded examples, ready for the model.
// Legend: B examples, S = longest source in the batch, T = kIsoLength + 1 = 11.
struct Batch {
  std::int64_t batch = 0, source_len = 0, target_len = 0;  // B, S, T
  std::vector<int> source;                                 // [B, S] ids, padded with kPad after each source
  std::vector<std::int64_t> source_lengths;                // [B] unpadded source lengths
  std::vector<int> target_in;                              // [B, T] <bos> y1 .. y10 (decoder input, teacher forcing)
  std::vector<int> target_out;                             // [B, T] y1 .. y10 <eos> (what the decoder must predict)
};
// Throws std::invalid_argument when a target is not kIsoLength characters or a source or target has a
// character outside `vocab` (the message names the example). An empty span gives B = S = 0, T = 11.
Batch make_batch(std::span<const DateExample> examples, const Vocabulary& vocab);

}  // namespace transformer
