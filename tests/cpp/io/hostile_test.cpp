// Hostile files: every way a safetensors or .npy file can lie about itself, each refused with an
// mha::Error that names the file and the problem, with no crash, no read outside the bytes and no
// allocation on a size the file merely claims (a claimed 10^18-element tensor in a tiny file must
// fail on its size check, not in the allocator).
//
// The table below is the source of truth. Its files are also committed under tests/data/hostile/
// (regenerate them with MHA_REGENERATE_HOSTILE=1 ./build/tests/mha_tests --gtest_filter='IoHostileFiles.*'),
// and every file in that folder is read back by IoHostileFiles.CommittedFilesAreRefused, so a file stays
// a regression test even if its table entry changes.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <typeinfo>
#include <vector>

#include "support/io_bytes.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

namespace fs = std::filesystem;

struct HostileCase {
  const char* file;  // file name; the extension says which reader
  Bytes bytes;
  const char* expected;  // a substring of the error message
};

void PrintTo(const HostileCase& c, std::ostream* os) { *os << c.file; }

// One F32 tensor "w" with the given dtype, shape and data_offsets (JSON text), in a header.
std::string tensor_header(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"w":{"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
}

std::vector<HostileCase> safetensors_cases() {
  using u64 = std::uint64_t;
  const std::string ok_w = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  return {
      {"st_empty.safetensors", {}, "shorter than the 8-byte header length"},
      {"st_7_bytes.safetensors", zeros(7), "shorter than the 8-byte header length"},
      {"st_header_past_end.safetensors", cat({le<u64>(100), raw("{}")}), "runs past the end of the file"},
      {"st_header_over_limit.safetensors", cat({le<u64>(100'000'001), raw("{}")}), "exceeds the limit"},
      {"st_header_length_max.safetensors", cat({le<u64>(std::numeric_limits<u64>::max()), raw("{}")}),
       "exceeds the limit"},
      {"st_header_not_utf8.safetensors", safetensors_bytes("{\"a\xff\": 1}"), "not valid UTF-8"},
      {"st_header_overlong_utf8.safetensors", safetensors_bytes("{\"\xc0\xaf\": 1}"), "not valid UTF-8"},
      {"st_header_surrogate_utf8.safetensors", safetensors_bytes("{\"\xed\xa0\x80\": 1}"), "not valid UTF-8"},
      {"st_header_not_json.safetensors", safetensors_bytes("{hello}"), "not valid JSON"},
      {"st_header_empty.safetensors", safetensors_bytes(""), "not valid JSON"},
      {"st_header_array.safetensors", safetensors_bytes("[1, 2]"), "not a JSON object"},
      {"st_header_string.safetensors", safetensors_bytes("\"w\""), "not a JSON object"},
      {"st_header_trailing_garbage.safetensors", safetensors_bytes("{} x"), "not valid JSON"},
      {"st_header_nul_padding.safetensors", safetensors_bytes(std::string("{}\0\0\0\0\0\0", 8)), "not valid JSON"},
      {"st_header_unterminated.safetensors", safetensors_bytes(R"({"w":{"dtype":"F32")"), "not valid JSON"},
      {"st_deep_nesting.safetensors", safetensors_bytes("{\"w\":" + std::string(4096, '[')), "expected an object"},
      {"st_entry_not_object.safetensors", safetensors_bytes(R"({"w": 3})"), "expected an object"},
      {"st_missing_offsets.safetensors", safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1]}})", zeros(4)),
       "missing \"data_offsets\""},
      {"st_missing_dtype.safetensors", safetensors_bytes(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", zeros(4)),
       "missing \"dtype\""},
      {"st_unknown_key.safetensors",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", zeros(4)),
       "unknown key 'x'"},
      {"st_duplicate_key_in_entry.safetensors",
       safetensors_bytes(R"({"w":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})", zeros(4)),
       "duplicate key 'dtype'"},
      {"st_unknown_dtype.safetensors", safetensors_bytes(tensor_header("\"F17\"", "[1]", "[0,4]"), zeros(4)),
       "unknown dtype 'F17'"},
      {"st_unsupported_dtype.safetensors", safetensors_bytes(tensor_header("\"I64\"", "[1]", "[0,8]"), zeros(8)),
       "unsupported dtype 'I64'"},
      {"st_dtype_not_string.safetensors", safetensors_bytes(tensor_header("4", "[1]", "[0,4]"), zeros(4)),
       "dtype must be a string"},
      {"st_shape_negative.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[-1]", "[0,4]"), zeros(4)),
       "negative size -1"},
      {"st_shape_float.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[2.5]", "[0,4]"), zeros(4)),
       "shape entries must be non-negative integers"},
      {"st_shape_bool.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[true]", "[0,4]"), zeros(4)),
       "shape entries must be non-negative integers"},
      {"st_shape_not_array.safetensors", safetensors_bytes(tensor_header("\"F32\"", "\"1\"", "[0,4]"), zeros(4)),
       "shape must be an array"},
      {"st_shape_nested.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[[1]]", "[0,4]"), zeros(4)),
       "shape entries must be non-negative integers, got an array"},
      {"st_shape_beyond_uint64.safetensors",
       safetensors_bytes(tensor_header("\"F32\"", "[100000000000000000000]", "[0,4]"), zeros(4)),
       "shape entries must be non-negative integers"},
      {"st_shape_beyond_int64.safetensors",
       safetensors_bytes(tensor_header("\"F32\"", "[9223372036854775808]", "[0,4]"), zeros(4)),
       "does not fit 64-bit sizes"},
      {"st_shape_product_overflow.safetensors",
       safetensors_bytes(tensor_header("\"F32\"", "[4294967296,4294967296]", "[0,4]"), zeros(4)), "overflows 64 bits"},
      {"st_byte_size_overflow.safetensors",
       safetensors_bytes(tensor_header("\"F64\"", "[1152921504606846976]", "[0,8]"), zeros(8)), "overflows 64 bits"},
      {"st_huge_shape_small_file.safetensors",
       safetensors_bytes(tensor_header("\"F32\"", "[1000000000,1000000000]", "[0,4]"), zeros(4)),
       "needs 4000000000000000000"},
      {"st_offsets_one_integer.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[0]"), zeros(4)),
       "data_offsets must be two integers [begin, end], got 1"},
      {"st_offsets_three_integers.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[0,4,8]"), zeros(8)),
       "data_offsets must be two integers [begin, end], got more"},
      {"st_offsets_not_integers.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[0,\"4\"]"), zeros(4)),
       "data_offsets must be two non-negative integers"},
      {"st_offsets_negative.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[-4,0]"), zeros(4)),
       "data_offsets must be two non-negative integers"},
      {"st_offsets_not_array.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "4"), zeros(4)),
       "data_offsets must be two integers"},
      {"st_offsets_reversed.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[4,0]"), zeros(4)),
       "are reversed"},
      {"st_offsets_out_of_buffer.safetensors",
       safetensors_bytes(tensor_header("\"F32\"", "[250]", "[0,1000]"), zeros(8)),
       "run past the end of the data buffer"},
      {"st_truncated_data.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[4]", "[0,16]"), zeros(10)),
       "is the file truncated?"},
      {"st_offsets_size_mismatch.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[3]", "[0,8]"), zeros(8)),
       "hold 8 bytes, but F32 [3] needs 12"},
      {"st_offsets_overlap.safetensors",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         zeros(12)),
       "overlaps tensor 'a'"},
      {"st_offsets_same_range.safetensors",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                         zeros(4)),
       "overlaps tensor"},
      {"st_offsets_gap.safetensors",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         zeros(12)),
       "belong to no tensor (a gap before tensor 'b')"},
      {"st_offsets_gap_at_start.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[4,8]"), zeros(8)),
       "bytes [0, 4] of the data buffer belong to no tensor"},
      {"st_buffer_not_covered.safetensors", safetensors_bytes(tensor_header("\"F32\"", "[1]", "[0,4]"), zeros(8)),
       "the last 4 bytes of the data buffer"},
      {"st_bytes_without_tensors.safetensors", safetensors_bytes("{}", zeros(3)),
       "the last 3 bytes of the data buffer"},
      {"st_duplicate_name.safetensors",
       safetensors_bytes(R"({"w":)" + ok_w + R"(,"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", zeros(8)),
       "duplicate tensor name 'w'"},
      {"st_duplicate_metadata.safetensors", safetensors_bytes(R"({"__metadata__":{},"__metadata__":{}})"),
       "duplicate key \"__metadata__\""},
      {"st_metadata_duplicate_key.safetensors", safetensors_bytes(R"({"__metadata__":{"a":"1","a":"2"}})"),
       "__metadata__: duplicate key 'a'"},
      {"st_metadata_not_strings.safetensors", safetensors_bytes(R"({"__metadata__":{"a":1}})"),
       "the value of 'a' must be a string"},
      {"st_metadata_not_object.safetensors", safetensors_bytes(R"({"__metadata__":[1]})"),
       "__metadata__ must be an object of strings"},
  };
}

std::vector<HostileCase> npy_cases() {
  const std::string f4_1 = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }";
  const auto header = [](const std::string& descr, const std::string& order, const std::string& shape) {
    return "{'descr': " + descr + ", 'fortran_order': " + order + ", 'shape': " + shape + ", }";
  };
  return {
      {"npy_empty.npy", {}, "not a .npy file"},
      {"npy_bad_magic.npy", cat({raw("\x93NUMPZ\x01"), zeros(1), le<std::uint16_t>(0)}), "not a .npy file"},
      {"npy_text_file.npy", raw("hello, world\n"), "not a .npy file"},
      {"npy_magic_only.npy", raw("\x93NUMPY"), "ends inside the format version"},
      {"npy_truncated_length.npy", cat({raw("\x93NUMPY\x01"), zeros(1), raw("\x05")}), "ends inside the header length"},
      {"npy_version_4_0.npy", npy_bytes(f4_1, zeros(4), 4, 0), "unsupported .npy format version 4.0"},
      {"npy_version_1_1.npy", npy_bytes(f4_1, zeros(4), 1, 1), "unsupported .npy format version 1.1"},
      {"npy_version_0_0.npy", npy_bytes(f4_1, zeros(4), 0, 0), "unsupported .npy format version 0.0"},
      {"npy_header_past_end.npy", cat({raw("\x93NUMPY\x01"), zeros(1), le<std::uint16_t>(1000), raw("{}")}),
       "runs past the end of the file"},
      {"npy_header_over_limit.npy", cat({raw("\x93NUMPY\x02"), zeros(1), le<std::uint32_t>(0xffffffffu), raw("{}")}),
       "exceeds the limit"},
      {"npy_header_not_dict.npy", npy_bytes("[1, 2]", {}), "dict literal"},
      {"npy_header_empty.npy", npy_bytes("", {}), "dict literal"},
      {"npy_header_unterminated_dict.npy", npy_bytes("{'descr': '<f4'", {}), "expected ',' or '}'"},
      {"npy_header_missing_shape.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False}", zeros(4)),
       "missing key 'shape'"},
      {"npy_header_unknown_key.npy",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", zeros(4)), "unknown key 'x'"},
      {"npy_header_duplicate_key.npy",
       npy_bytes("{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, 'shape': (1,)}", zeros(4)),
       "duplicate key 'descr'"},
      {"npy_header_key_not_string.npy", npy_bytes("{descr: '<f4'}", zeros(4)), "expected a dict key"},
      {"npy_fortran_order_not_bool.npy", npy_bytes(header("'<f4'", "0", "(1,)"), zeros(4)),
       "fortran_order must be True or False"},
      {"npy_unterminated_string.npy", npy_bytes("{'descr': '<f4", zeros(4)), "unterminated string"},
      {"npy_string_escape.npy", npy_bytes(header("'<f\\x34'", "False", "(1,)"), zeros(4)), "escape sequences"},
      {"npy_header_trailing_garbage.npy", npy_bytes(f4_1 + " x", zeros(4)), "after the dict"},
      {"npy_header_eval_attempt.npy", npy_bytes(header("__import__('os').system('true')", "False", "(1,)"), zeros(4)),
       "expected descr as a quoted string"},
      {"npy_header_non_ascii.npy", npy_bytes(header("'<f\xe9'", "False", "(1,)"), zeros(4)), "inside a string"},
      {"npy_descr_int64.npy", npy_bytes(header("'<i8'", "False", "(1,)"), zeros(8)), "unsupported descr '<i8'"},
      {"npy_descr_object.npy", npy_bytes(header("'|O'", "False", "(1,)"), zeros(8)), "unsupported descr '|O'"},
      {"npy_descr_big_endian.npy", npy_bytes(header("'>f4'", "False", "(1,)"), zeros(4)), "big-endian"},
      {"npy_descr_structured.npy", npy_bytes(header("[('a', '<f4')]", "False", "(1,)"), zeros(4)), "structured dtypes"},
      {"npy_shape_negative.npy", npy_bytes(header("'<f4'", "False", "(-1,)"), zeros(4)), "negative size"},
      {"npy_shape_list.npy", npy_bytes(header("'<f4'", "False", "[1]"), zeros(4)), "shape must be a tuple"},
      {"npy_shape_float.npy", npy_bytes(header("'<f4'", "False", "(1.0,)"), zeros(4)),
       "shape entries must be integers"},
      {"npy_shape_parenthesised_int.npy", npy_bytes(header("'<f4'", "False", "(1)"), zeros(4)),
       "parenthesised integer"},
      {"npy_shape_missing_comma.npy", npy_bytes(header("'<f4'", "False", "(1 2)"), zeros(8)),
       "expected ',' or ')' in shape"},
      {"npy_shape_beyond_int64.npy", npy_bytes(header("'<f4'", "False", "(99999999999999999999,)"), zeros(4)),
       "does not fit 64 bits"},
      {"npy_shape_product_overflow.npy", npy_bytes(header("'<f4'", "False", "(4294967296, 4294967296)"), zeros(4)),
       "overflows 64 bits"},
      {"npy_huge_shape_small_file.npy", npy_bytes(header("'<f4'", "False", "(1000000000, 1000000000)"), zeros(4)),
       "needs 4000000000000000000"},
      {"npy_truncated_data.npy", npy_bytes(header("'<f4'", "False", "(4,)"), zeros(8)),
       "the data is 8 bytes, but shape [4] of <f4 needs 16 (is the file truncated?)"},
      {"npy_data_too_long.npy", npy_bytes(f4_1, zeros(8)), "the data is 8 bytes, but shape [1] of <f4 needs 4"},
      {"npy_fortran_shape_mismatch.npy", npy_bytes(header("'<f8'", "True", "(2, 3)"), zeros(40)), "needs 48"},
  };
}

std::vector<HostileCase> all_cases() {
  std::vector<HostileCase> cases = safetensors_cases();
  for (auto& c : npy_cases()) cases.push_back(std::move(c));
  return cases;
}

bool is_npy(const std::string& file) { return fs::path(file).extension() == ".npy"; }

// Parses `bytes` with the reader the extension names, as `name`; returns the error message, or ""
// when nothing was thrown (a failure of the test).
std::string parse_error(const std::string& file, const Bytes& bytes, const std::string& name) {
  try {
    if (is_npy(file)) mha::parse_npy(bytes, name);
    else mha::parse_safetensors(bytes, name);
  } catch (const mha::Error& e) {
    return e.what();
  }
  return "";
}

std::string read_error(const std::string& path) {
  try {
    if (is_npy(path)) mha::read_npy(path);
    else mha::read_safetensors(path);
  } catch (const mha::Error& e) {
    return e.what();
  }
  return "";
}

fs::path hostile_dir() {
  if (const char* dir = std::getenv("MHA_TEST_HOSTILE_DIR")) return dir;
  return fs::path(__FILE__).parent_path().parent_path().parent_path() / "data" / "hostile";  // from tests/cpp/io/
}

class IoHostile : public ::testing::TestWithParam<HostileCase> {};

TEST_P(IoHostile, RefusedFromMemoryAndFromFile) {
  const HostileCase& c = GetParam();
  for (auto dtype : {std::optional<DType>(), std::optional<DType>(DType::Float64)}) {
    if (is_npy(c.file) && dtype) continue;  // npy has no dtype argument
    std::string message;
    try {
      if (is_npy(c.file)) mha::parse_npy(c.bytes, c.file);
      else mha::parse_safetensors(c.bytes, c.file, dtype);
    } catch (const mha::Error& e) {
      message = e.what();
    } catch (const std::exception& e) {
      FAIL() << c.file << ": threw a " << typeid(e).name() << " instead of mha::Error: " << e.what();
    }
    ASSERT_FALSE(message.empty()) << c.file << " was accepted";
    EXPECT_EQ(message.rfind(std::string(c.file) + ": ", 0), 0u) << "message does not start with the name: " << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << "expected \"" << c.expected << "\" in: " << message;
  }
  // The same through a real file: the message names the path.
  TempDir dir("hostile");
  const std::string path = dir / c.file;
  write_file(path, c.bytes);
  const std::string message = read_error(path);
  ASSERT_FALSE(message.empty()) << path << " was accepted";
  EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
  EXPECT_NE(message.find(c.expected), std::string::npos) << "expected \"" << c.expected << "\" in: " << message;
}

INSTANTIATE_TEST_SUITE_P(Table, IoHostile, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<HostileCase>& info) {
                           std::string name = fs::path(info.param.file).stem().string();
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name + (is_npy(info.param.file) ? "_npy" : "_safetensors");
                         });

TEST(IoHostileTable, NamesAreUniqueAndCasesMany) {
  std::set<std::string> names;
  for (const auto& c : all_cases()) EXPECT_TRUE(names.insert(c.file).second) << "duplicate case " << c.file;
  EXPECT_GE(safetensors_cases().size(), 25u);
  EXPECT_GE(npy_cases().size(), 25u);
}

// Every committed file is refused, naming its path; a file that has a table entry still holds the
// table's bytes. MHA_REGENERATE_HOSTILE=1 rewrites the folder from the table first.
TEST(IoHostileFiles, CommittedFilesAreRefused) {
  const fs::path dir = hostile_dir();
  const auto cases = all_cases();
  if (std::getenv("MHA_REGENERATE_HOSTILE")) {
    fs::create_directories(dir);
    for (const auto& c : cases) write_file(dir / c.file, c.bytes);
  }
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " is missing";
  std::size_t count = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string path = entry.path().string();
    const std::string ext = entry.path().extension().string();
    if (ext != ".npy" && ext != ".safetensors") continue;
    ++count;
    const std::string message = read_error(path);
    EXPECT_FALSE(message.empty()) << path << " was accepted";
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    for (const auto& c : cases)
      if (entry.path().filename() == c.file) {
        EXPECT_NE(message.find(c.expected), std::string::npos) << path << ": " << message;
        EXPECT_TRUE(read_file(entry.path()) == c.bytes) << path << " differs from its table entry; regenerate";
      }
  }
  EXPECT_GE(count, 50u) << "hostile files in " << dir;
}

// Small corruptions of a valid file (every byte flipped in turn, every truncation) must each be read
// or refused with mha::Error, never anything worse. A cheap deterministic cousin of the fuzzers.
TEST(IoHostileMutations, EveryByteFlipAndTruncationOfValidFiles) {
  const Tensor a = make_tensor(DType::Float32, {2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor b = make_tensor(DType::Bool, {3}, {1, 0, 1});
  const Bytes st = mha::serialize_safetensors({{"a", a}, {"b", b}}, {{"k", "v"}});
  const Bytes np = mha::serialize_npy(a);
  for (const auto& [file, valid] : {std::pair{std::string("m.safetensors"), st}, std::pair{std::string("m.npy"), np}}) {
    for (std::size_t cut = 0; cut < valid.size(); ++cut) {
      const Bytes truncated(valid.begin(), valid.begin() + static_cast<std::ptrdiff_t>(cut));
      EXPECT_FALSE(parse_error(file, truncated, file).empty())
          << file << " truncated to " << cut << " bytes was accepted";
    }
    for (std::size_t i = 0; i < valid.size(); ++i)
      for (unsigned char flip : {0x01, 0x80, 0xff}) {
        Bytes mutated = valid;
        mutated[i] ^= std::byte{flip};
        try {
          is_npy(file) ? static_cast<void>(mha::parse_npy(mutated, file))
                       : static_cast<void>(mha::parse_safetensors(mutated, file));
        } catch (const mha::Error&) {
        } catch (const std::exception& e) {
          ADD_FAILURE() << file << " byte " << i << " ^ " << int(flip) << ": " << e.what();
        }
      }
  }
}

}  // namespace
}  // namespace mha_test
