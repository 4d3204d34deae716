// Where the date's fields meet on the encoder-decoder maps (demo_fields.hpp).
#include "commands/demo_fields.hpp"

#include <stdexcept>

namespace mha_cli {

std::vector<Highlight> field_boxes(const transformer::DateFields& fields) {
  std::vector<Highlight> boxes;
  for (const DateFieldStyle& f : kDateFieldStyles) {
    const transformer::CharSpan& span = fields.*f.span;
    boxes.push_back(
        {f.first_row, f.rows, static_cast<std::int64_t>(span.begin), static_cast<std::int64_t>(span.size()), f.colour});
  }
  return boxes;
}

double field_share(std::span<const float> weights, std::int64_t S, const transformer::DateFields& fields) {
  const auto T = static_cast<std::int64_t>(transformer::kIsoLength) + 1;
  if (S <= 0 || static_cast<std::int64_t>(weights.size()) != T * S)
    throw std::logic_error("field_share: weights are not [11, S]");
  double inside = 0;
  std::int64_t rows = 0;
  for (const DateFieldStyle& f : kDateFieldStyles) {
    const transformer::CharSpan& span = fields.*f.span;
    if (static_cast<std::int64_t>(span.end) > S) throw std::logic_error("field_share: a field lies past the source");
    for (std::int64_t r = f.first_row; r < f.first_row + f.rows; ++r, ++rows)
      for (std::size_t c = span.begin; c < span.end; ++c) inside += weights[static_cast<std::size_t>(r * S) + c];
  }
  return inside / static_cast<double>(rows);
}

double even_field_share(std::int64_t S, const transformer::DateFields& fields) {
  const auto T = static_cast<std::int64_t>(transformer::kIsoLength) + 1;
  const std::vector<float> even(static_cast<std::size_t>(T * S), 1.0f / static_cast<float>(S));
  return field_share(even, S, fields);
}

}  // namespace mha_cli
