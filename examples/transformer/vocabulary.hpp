// The character-level vocabulary of the date-normalisation task. The alphabet is FIXED (not derived
// from data) so that a checkpoint's embedding rows keep their meaning. The ids, in order:
//   0 <pad>, 1 <bos>, 2 <eos>,
//   3..28  'a'..'z',
//   29..54 'A'..'Z',
//   55..64 '0'..'9',
//   65     ' ' (space),
//   66..70 ',' '.' '/' '-' '\''   (the punctuation the date formats use; the apostrophe is reserved)
// 71 ids in all. New characters may only ever be appended, never inserted.
#pragma once

#include <array>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace transformer {

class Vocabulary {
 public:
  static constexpr int kPad = 0, kBos = 1, kEos = 2;
  // The characters with ids kFirstChar, kFirstChar + 1, ... in that order.
  static constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,./-'";
  static constexpr int kFirstChar = 3;

  Vocabulary();  // the fixed alphabet above

  // Number of ids: 3 special tokens + kAlphabet.size().
  int size() const;

  // One id per character, no <bos>/<eos>. Throws std::invalid_argument naming the first character
  // outside the vocabulary and its (0-based) position, e.g.
  // "character '#' at position 3 is not in the vocabulary (letters, digits, space and , . / - ')".
  std::vector<int> encode(std::string_view text) const;

  // The text of `ids`: stops at the first <eos>, skips <pad> and <bos>. Throws std::invalid_argument
  // for an id outside [0, size()).
  std::string decode(std::span<const int> ids) const;

  // A printable ASCII label for plot axes: "<pad>", "<bos>", "<eos>", "_" for the space, otherwise
  // the character itself. Throws std::invalid_argument for an id outside [0, size()).
  std::string token_label(int id) const;

  // Whether `c` has an id.
  bool contains(char c) const;

 private:
  std::array<int, 256> id_of_byte_{};  // -1 for bytes outside the alphabet
};

}  // namespace transformer
