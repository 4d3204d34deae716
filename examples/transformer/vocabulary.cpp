// The fixed character vocabulary of the date-normalisation task (see vocabulary.hpp for the id layout).
#include "transformer/vocabulary.hpp"

#include <cstdio>
#include <stdexcept>

namespace transformer {

namespace {

// "character '#'" for a printable ASCII character, "byte 0xc3 (not ASCII)" for anything else (UTF-8
// parts), "control byte 0x09" below the space.
std::string describe_char(char c) {
  const auto byte = static_cast<unsigned char>(c);
  if (byte >= 0x20 && byte < 0x7f) return std::string("character '") + c + "'";
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, byte < 0x20 ? "control byte 0x%02x" : "byte 0x%02x (not ASCII)", byte);
  return buffer;
}

void check_id(int id, int size) {
  if (id < 0 || id >= size)
    throw std::invalid_argument("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                std::to_string(size) + ")");
}

}  // namespace

Vocabulary::Vocabulary() {
  id_of_byte_.fill(-1);
  for (std::size_t i = 0; i < kAlphabet.size(); ++i)
    id_of_byte_[static_cast<unsigned char>(kAlphabet[i])] = kFirstChar + static_cast<int>(i);
}

int Vocabulary::size() const { return kFirstChar + static_cast<int>(kAlphabet.size()); }

bool Vocabulary::contains(char c) const { return id_of_byte_[static_cast<unsigned char>(c)] >= 0; }

std::vector<int> Vocabulary::encode(std::string_view text) const {
  std::vector<int> ids;
  ids.reserve(text.size());
  for (std::size_t pos = 0; pos < text.size(); ++pos) {
    const int id = id_of_byte_[static_cast<unsigned char>(text[pos])];
    if (id < 0)
      throw std::invalid_argument(describe_char(text[pos]) + " at position " + std::to_string(pos) +
                                  " is not in the vocabulary (letters, digits, space and , . / - ')");
    ids.push_back(id);
  }
  return ids;
}

std::string Vocabulary::decode(std::span<const int> ids) const {
  std::string text;
  for (const int id : ids) {
    check_id(id, size());
    if (id == kEos) break;
    if (id == kPad || id == kBos) continue;
    text += kAlphabet[static_cast<std::size_t>(id - kFirstChar)];
  }
  return text;
}

std::string Vocabulary::token_label(int id) const {
  check_id(id, size());
  if (id == kPad) return "<pad>";
  if (id == kBos) return "<bos>";
  if (id == kEos) return "<eos>";
  const char c = kAlphabet[static_cast<std::size_t>(id - kFirstChar)];
  return c == ' ' ? "_" : std::string(1, c);
}

}  // namespace transformer
