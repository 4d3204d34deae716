// transformer::Vocabulary: the documented id layout (which checkpoints depend on), encode / decode
// round trips, <pad>/<bos>/<eos> handling in decode, the error message of encode, token labels.
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "transformer/vocabulary.hpp"

namespace transformer_test {
namespace {

using transformer::Vocabulary;

// Every character the header promises, in its documented order: a-z, A-Z, 0-9, space, , . / - '.
std::string documented_alphabet() {
  std::string s;
  for (char c = 'a'; c <= 'z'; ++c) s += c;
  for (char c = 'A'; c <= 'Z'; ++c) s += c;
  for (char c = '0'; c <= '9'; ++c) s += c;
  return s + " ,./-'";
}

// The message of the std::invalid_argument that `f` throws ("" and a test failure if none).
template <class F>
std::string invalid_argument_message(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no std::invalid_argument thrown";
  return "";
}

TEST(Vocabulary, SpecialIdsAndSize) {
  const Vocabulary v;
  EXPECT_EQ(Vocabulary::kPad, 0);
  EXPECT_EQ(Vocabulary::kBos, 1);
  EXPECT_EQ(Vocabulary::kEos, 2);
  EXPECT_EQ(v.size(), 3 + 26 + 26 + 10 + 1 + 5);
}

// The layout of vocabulary.hpp: 'a' = 3 .. 'z' = 28, 'A' = 29 .. 'Z' = 54, '0' = 55 .. '9' = 64,
// ' ' = 65, then , . / - ' = 66 .. 70. A change here invalidates every saved checkpoint.
TEST(Vocabulary, DocumentedIdLayout) {
  const Vocabulary v;
  EXPECT_EQ(v.encode("a")[0], 3);
  EXPECT_EQ(v.encode("z")[0], 28);
  EXPECT_EQ(v.encode("A")[0], 29);
  EXPECT_EQ(v.encode("Z")[0], 54);
  EXPECT_EQ(v.encode("0")[0], 55);
  EXPECT_EQ(v.encode("9")[0], 64);
  EXPECT_EQ(v.encode(" ")[0], 65);
  EXPECT_EQ(v.encode(",./-'"), (std::vector<int>{66, 67, 68, 69, 70}));
  const std::string alphabet = documented_alphabet();
  const std::vector<int> ids = v.encode(alphabet);
  for (std::size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], 3 + static_cast<int>(i)) << alphabet[i];
}

TEST(Vocabulary, ContainsExactlyTheDocumentedCharacters) {
  const Vocabulary v;
  const std::string alphabet = documented_alphabet();
  for (int byte = 0; byte < 256; ++byte) {
    const char c = static_cast<char>(byte);
    EXPECT_EQ(v.contains(c), alphabet.find(c) != std::string::npos) << "byte " << byte;
  }
}

TEST(Vocabulary, EncodeDecodeRoundTrip) {
  const Vocabulary v;
  for (const std::string& text : {std::string(""), std::string("5 March 2021"), std::string("Fri, 5 Mar 21"),
                                  std::string("the thirty-first of December 1999"), std::string("05/03/2021"),
                                  std::string("2021.03.05"), std::string("it's"), documented_alphabet()}) {
    const std::vector<int> ids = v.encode(text);
    ASSERT_EQ(ids.size(), text.size());
    for (const int id : ids) {
      EXPECT_GE(id, 3);
      EXPECT_LT(id, v.size());
    }
    EXPECT_EQ(v.decode(ids), text);
  }
}

TEST(Vocabulary, DecodeSkipsPadAndBosAndStopsAtEos) {
  const Vocabulary v;
  const int a = v.encode("a")[0], b = v.encode("b")[0], c = v.encode("c")[0];
  const int pad = Vocabulary::kPad, bos = Vocabulary::kBos, eos = Vocabulary::kEos;
  EXPECT_EQ(v.decode(std::vector<int>{bos, a, b, eos, c}), "ab");
  EXPECT_EQ(v.decode(std::vector<int>{a, pad, b, pad, pad}), "ab");
  EXPECT_EQ(v.decode(std::vector<int>{eos, a}), "");
  EXPECT_EQ(v.decode(std::vector<int>{}), "");
  EXPECT_EQ(v.decode(std::vector<int>{bos, c, a, b, pad, pad}), "cab");
}

TEST(Vocabulary, DecodeRejectsOutOfRangeIds) {
  const Vocabulary v;
  EXPECT_THROW(v.decode(std::vector<int>{3, -1}), std::invalid_argument);
  EXPECT_THROW(v.decode(std::vector<int>{v.size()}), std::invalid_argument);
}

TEST(Vocabulary, EncodeErrorNamesCharacterAndPosition) {
  const Vocabulary v;
  const std::string m = invalid_argument_message([&] { v.encode("5 M#rch 2021"); });
  EXPECT_NE(m.find("'#'"), std::string::npos) << m;
  EXPECT_NE(m.find("position 3"), std::string::npos) << m;
  EXPECT_NE(m.find("not in the vocabulary"), std::string::npos) << m;

  // The FIRST offending character is named, at position 0 here.
  const std::string first = invalid_argument_message([&] { v.encode("!a?"); });
  EXPECT_NE(first.find("'!'"), std::string::npos) << first;
  EXPECT_NE(first.find("position 0"), std::string::npos) << first;

  // A non-ASCII byte (the first byte of UTF-8 "é") is named without printing a broken character.
  const std::string utf8 = invalid_argument_message([&] { v.encode("caf\xc3\xa9"); });
  EXPECT_NE(utf8.find("position 3"), std::string::npos) << utf8;
  EXPECT_NE(utf8.find("0xc3"), std::string::npos) << utf8;
}

TEST(Vocabulary, TokenLabels) {
  const Vocabulary v;
  EXPECT_EQ(v.token_label(Vocabulary::kPad), "<pad>");
  EXPECT_EQ(v.token_label(Vocabulary::kBos), "<bos>");
  EXPECT_EQ(v.token_label(Vocabulary::kEos), "<eos>");
  EXPECT_EQ(v.token_label(v.encode(" ")[0]), "_");
  EXPECT_EQ(v.token_label(v.encode("q")[0]), "q");
  EXPECT_EQ(v.token_label(v.encode("Q")[0]), "Q");
  EXPECT_EQ(v.token_label(v.encode("7")[0]), "7");
  EXPECT_EQ(v.token_label(v.encode("/")[0]), "/");
  EXPECT_THROW(v.token_label(-1), std::invalid_argument);
  EXPECT_THROW(v.token_label(v.size()), std::invalid_argument);

  // Labels are distinct, non-empty and printable ASCII, so plot axes are unambiguous.
  std::set<std::string> labels;
  for (int id = 0; id < v.size(); ++id) {
    const std::string label = v.token_label(id);
    ASSERT_FALSE(label.empty());
    for (const char c : label) EXPECT_TRUE(c > ' ' && c < 0x7f) << "id " << id;
    labels.insert(label);
  }
  EXPECT_EQ(labels.size(), static_cast<std::size_t>(v.size()));
}

}  // namespace
}  // namespace transformer_test
