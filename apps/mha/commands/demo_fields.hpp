// The fields of a date (year, month, day) on the demo's encoder-decoder maps: the blocks of cells where
// the decoder rows that write a field meet the source characters that hold it, and how much of a head's
// weight falls in them.
//
// Legend: T = 11 decoder rows (<bos> y1 .. y10), S source characters. Row r of the decoder's input is
// the step that writes character r of "yyyy-mm-dd" (row 0, <bos>, writes the year's first digit), so
// rows 0-3 write the year, 5-6 the month and 8-9 the day; rows 4 and 7 write the dashes, row 10 <eos>.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "render/attention_map.hpp"
#include "transformer/dates.hpp"

namespace mha_cli {

struct DateFieldStyle {
  const char* name;                                      // "year", "month", "day"
  Rgb colour;                                            // its boxes' outline, and the report's legend
  std::int64_t first_row, rows;                          // the decoder rows that write it
  transformer::CharSpan transformer::DateFields::*span;  // where the source holds it
};
// Colours from Okabe and Ito's colour-blind-safe palette, apart from the maps' blues.
inline constexpr DateFieldStyle kDateFieldStyles[] = {
    {"year", {213, 94, 0}, 0, 4, &transformer::DateFields::year},     // vermillion
    {"month", {0, 158, 115}, 5, 2, &transformer::DateFields::month},  // bluish green
    {"day", {204, 121, 167}, 8, 2, &transformer::DateFields::day},    // reddish purple
};

// One block per field: its decoder rows x its source characters, for AttentionMap::highlights.
std::vector<Highlight> field_boxes(const transformer::DateFields& fields);

// weights: [T, S], one head's encoder-decoder attention for one example (each row sums to 1). The mean,
// over the 8 rows that write the year, month and day, of the weight a row puts on its field's source
// characters: 1 when those rows read nothing else.
double field_share(std::span<const float> weights, std::int64_t S, const transformer::DateFields& fields);

// field_share of a head that spreads each row's weight evenly over the S source characters: the share
// that says nothing.
double even_field_share(std::int64_t S, const transformer::DateFields& fields);

}  // namespace mha_cli
