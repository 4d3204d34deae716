// File formats (mha/io.hpp): safetensors and .npy round trips over dtypes and ranks 0..4 (empty
// tensors included), the exact bytes the writers produce, half / bfloat16 values from known bit
// patterns, the .npy header variants NumPy has written over the years, a MultiHeadAttention layer
// saved and loaded (parameters identical, forward equal), and interoperation with PyTorch and NumPy
// (files written by /usr/bin/python3 read here, and files written here read there).
// Hostile files are in hostile_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "support/io_bytes.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

namespace fs = std::filesystem;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;

const Shape kShapes[] = {{}, {0}, {5}, {2, 3}, {3, 0, 2}, {2, 3, 4}, {2, 1, 3, 2}, {0, 0, 0, 0}};
const DType kDTypes[] = {DType::Float32, DType::Float64, DType::Bool};

Tensor sample(DType dtype, const Shape& shape, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<double> v = random_values(mha::shape_numel(shape), rng, -3, 3);
  if (dtype == DType::Bool)
    for (auto& x : v) x = x > 0 ? 1 : 0;
  return make_tensor(dtype, shape, v);
}

// ---- safetensors ---------------------------------------------------------------------------------

TEST(IoSafetensors, RoundTripEveryDtypeAndRank) {
  TempDir dir("st_round_trip");
  std::map<std::string, Tensor> originals;
  std::uint64_t seed = 1;
  for (DType dtype : kDTypes)
    for (const Shape& shape : kShapes)
      originals.emplace(std::string(mha::dtype_name(dtype)) + "/" + mha::shape_str(shape),
                        sample(dtype, shape, seed++));
  std::map<std::string, TensorView> views;
  for (const auto& [name, t] : originals) views.emplace(name, t.view());
  const std::string path = dir / "all.safetensors";
  mha::write_safetensors(path, views);
  EXPECT_TRUE(read_file(path) == mha::serialize_safetensors(views)) << "file and serialize differ";

  const mha::SafetensorsFile file = mha::read_safetensors(path);
  EXPECT_TRUE(file.metadata.empty());
  ASSERT_EQ(file.tensors.size(), originals.size());
  for (const auto& [name, t] : originals) {
    ASSERT_TRUE(file.tensors.count(name)) << name;
    EXPECT_TRUE(bitwise_equal(file.tensors.at(name), t)) << name;
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1)
      << "a partial file was left beside " << path;
}

TEST(IoSafetensors, ComputeDtypeConvertsFloatsAndKeepsBool) {
  const Tensor f32 = make_tensor(DType::Float32, {3}, {0.5, -1.25, 3});
  const Tensor f64 = make_tensor(DType::Float64, {2}, {0.1, 1e300});
  const Tensor b = make_tensor(DType::Bool, {2}, {1, 0});
  const Bytes bytes = mha::serialize_safetensors({{"f32", f32}, {"f64", f64}, {"b", b}});
  const auto as64 = mha::parse_safetensors(bytes, "x", DType::Float64);
  EXPECT_EQ(as64.tensors.at("f32").dtype(), DType::Float64);
  EXPECT_EQ(to_doubles(as64.tensors.at("f32")), (std::vector<double>{0.5, -1.25, 3}));
  EXPECT_EQ(to_doubles(as64.tensors.at("f64")), (std::vector<double>{0.1, 1e300}));
  EXPECT_EQ(as64.tensors.at("b").dtype(), DType::Bool);
  const auto as32 = mha::parse_safetensors(bytes, "x", DType::Float32);
  EXPECT_EQ(as32.tensors.at("f64").dtype(), DType::Float32);
  EXPECT_EQ(to_doubles(as32.tensors.at("f64"))[0], static_cast<double>(0.1f));
  EXPECT_TRUE(std::isinf(to_doubles(as32.tensors.at("f64"))[1]));  // 1e300 overflows float, as a cast does
  try {
    mha::parse_safetensors(bytes, "x.safetensors", DType::Bool);
    FAIL() << "bool compute dtype accepted";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.safetensors: dtype"), std::string::npos) << e.what();
  }
}

TEST(IoSafetensors, StridedViewsAreWrittenInCOrder) {
  const Tensor t = make_tensor(DType::Float64, {2, 3}, {1, 2, 3, 4, 5, 6});
  const TensorView transposed(t.data(), DType::Float64, {3, 2}, {1, 3});
  const TensorView broadcast(t.data(), DType::Float64, {2, 2}, {0, 1});
  const auto file = mha::parse_safetensors(mha::serialize_safetensors({{"t", transposed}, {"b", broadcast}}), "x");
  EXPECT_EQ(to_doubles(file.tensors.at("t")), (std::vector<double>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(to_doubles(file.tensors.at("b")), (std::vector<double>{1, 2, 1, 2}));
}

TEST(IoSafetensors, MetadataRoundTrips) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"empty", ""}, {"unicode \xc3\xa9\xe2\x82\xac", "quote \" backslash \\ newline \n"}};
  const Tensor t = make_tensor(DType::Float32, {1}, {7});
  const auto file = mha::parse_safetensors(mha::serialize_safetensors({{"t", t}}, metadata), "x");
  EXPECT_EQ(file.metadata, metadata);
  // Metadata alone, no tensors, is a valid file too.
  const auto only = mha::parse_safetensors(mha::serialize_safetensors({}, metadata), "x");
  EXPECT_TRUE(only.tensors.empty());
  EXPECT_EQ(only.metadata, metadata);
}

// The bytes of a small file, spelled out: header padded with spaces to a multiple of 8, wider dtypes
// first then by name, offsets without gaps.
TEST(IoSafetensors, WriterLayoutIsExact) {
  const Tensor a = make_tensor(DType::Float32, {1}, {1.0});
  const Tensor b = make_tensor(DType::Bool, {2}, {1, 0});
  const Tensor c = make_tensor(DType::Float64, {1}, {2.0});
  const Bytes bytes = mha::serialize_safetensors({{"a", a}, {"b", b}, {"c", c}}, {{"k", "v"}});
  const std::string json = R"({"__metadata__":{"k":"v"},)"
                           R"("c":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},)"
                           R"("a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
                           R"("b":{"dtype":"BOOL","shape":[2],"data_offsets":[12,14]}})";
  std::string header = json;
  header.append((8 - header.size() % 8) % 8, ' ');
  const Bytes expected = safetensors_bytes(
      header, cat({elements<double>({2.0}), elements<float>({1.0f}), Bytes{std::byte{1}, std::byte{0}}}));
  EXPECT_EQ(to_string(bytes), to_string(expected));
}

TEST(IoSafetensors, ZeroSizeTensorsMayShareAnOffset) {
  const Bytes bytes = safetensors_bytes(R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                                        R"("f":{"dtype":"F64","shape":[2,0],"data_offsets":[4,4]},)"
                                        R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                        R"("z":{"dtype":"F16","shape":[0],"data_offsets":[0,0]}})",
                                        elements<float>({3.5f}));
  const auto file = mha::parse_safetensors(bytes, "x");
  EXPECT_EQ(file.tensors.at("e").shape(), (Shape{0}));
  EXPECT_EQ(file.tensors.at("f").shape(), (Shape{2, 0}));
  EXPECT_EQ(file.tensors.at("f").dtype(), DType::Float64);
  EXPECT_EQ(to_doubles(file.tensors.at("w")), (std::vector<double>{3.5}));
}

TEST(IoSafetensors, AcceptsNullMetadataWhitespaceAndUnpaddedHeaders) {
  const Bytes bytes = safetensors_bytes(" \n{ \"__metadata__\" : null , \"w\" : { \"data_offsets\" : [0, 4] , "
                                        "\"shape\" : [ ] , \"dtype\" : \"F32\" } } \t",
                                        elements<float>({-2.0f}));
  const auto file = mha::parse_safetensors(bytes, "x");
  EXPECT_TRUE(file.metadata.empty());
  EXPECT_EQ(file.tensors.at("w").shape(), Shape{});
  EXPECT_EQ(to_doubles(file.tensors.at("w")), (std::vector<double>{-2.0}));
}

TEST(IoSafetensors, BoolBytesAreNormalised) {
  const Bytes bytes = safetensors_bytes(R"({"b":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})",
                                        Bytes{std::byte{0}, std::byte{1}, std::byte{7}, std::byte{0xff}});
  const auto file = mha::parse_safetensors(bytes, "x");
  const Tensor& b = file.tensors.at("b");
  const auto* p = b.data_as<std::uint8_t>();
  EXPECT_EQ((std::vector<int>{p[0], p[1], p[2], p[3]}), (std::vector<int>{0, 1, 1, 1}));
}

struct HalfCase {
  std::uint16_t bits;
  double value;  // exact; NaN for NaN
};

// binary16: sign, 5-bit exponent (bias 15), 10-bit mantissa.
const HalfCase kHalfCases[] = {
    {0x0000, 0.0},
    {0x8000, -0.0},
    {0x3c00, 1.0},
    {0xc000, -2.0},
    {0x3555, 0.333251953125},
    {0x7bff, 65504.0},                      // largest finite
    {0x0400, std::ldexp(1.0, -14)},         // smallest normal
    {0x03ff, 1023 * std::ldexp(1.0, -24)},  // largest subnormal
    {0x0001, std::ldexp(1.0, -24)},         // smallest subnormal
    {0x8001, -std::ldexp(1.0, -24)},
    {0x7c00, kInf},
    {0xfc00, -kInf},
    {0x7e00, kNaN},
    {0x7c01, kNaN},  // signalling NaN stays NaN
    {0xfe00, kNaN},
};

// bfloat16: the top 16 bits of a float.
const HalfCase kBfloat16Cases[] = {
    {0x0000, 0.0},
    {0x8000, -0.0},
    {0x3f80, 1.0},
    {0xc040, -3.0},
    {0x3eaa, 0.33203125},
    {0x7f7f, 255 * std::ldexp(1.0, 120)},  // largest finite: (2 - 2^-7) * 2^127
    {0x0080, std::ldexp(1.0, -126)},       // smallest normal
    {0x0001, std::ldexp(1.0, -133)},       // smallest subnormal
    {0x7f80, kInf},
    {0xff80, -kInf},
    {0x7fc0, kNaN},
    {0x7f81, kNaN},
};

void expect_half_values(const char* dtype, const std::vector<HalfCase>& cases) {
  std::vector<std::uint16_t> bits;
  for (const auto& c : cases) bits.push_back(c.bits);
  Bytes data;
  for (auto b : bits) data = cat({data, le(b)});
  const std::string n = std::to_string(cases.size());
  const Bytes bytes = safetensors_bytes(std::string(R"({"h":{"dtype":")") + dtype + R"(","shape":[)" + n +
                                            R"(],"data_offsets":[0,)" + std::to_string(2 * cases.size()) + "]}}",
                                        data);
  for (auto compute : {DType::Float32, DType::Float64}) {
    const auto file = mha::parse_safetensors(bytes, "x", compute);
    const Tensor& t = file.tensors.at("h");
    ASSERT_EQ(t.dtype(), compute);
    const std::vector<double> got = to_doubles(t);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      char bits[16];
      std::snprintf(bits, sizeof bits, "0x%04x", static_cast<unsigned>(cases[i].bits));
      SCOPED_TRACE(std::string(dtype) + " bits " + bits);
      if (std::isnan(cases[i].value)) {
        EXPECT_TRUE(std::isnan(got[i])) << got[i];
      } else {
        EXPECT_EQ(got[i], cases[i].value);
        EXPECT_EQ(std::signbit(got[i]), std::signbit(cases[i].value));
      }
    }
  }
}

TEST(IoSafetensors, Float16ValuesFromBitPatterns) {
  expect_half_values("F16", std::vector<HalfCase>(std::begin(kHalfCases), std::end(kHalfCases)));
}

TEST(IoSafetensors, Bfloat16ValuesFromBitPatterns) {
  expect_half_values("BF16", std::vector<HalfCase>(std::begin(kBfloat16Cases), std::end(kBfloat16Cases)));
}

// Every one of the 65536 half bit patterns against an independent formula, (-1)^s * 2^(e-15) * (1 + m/1024)
// (subnormal: 2^-14 * m/1024).
TEST(IoSafetensors, Float16AllBitPatterns) {
  Bytes data;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    data.push_back(static_cast<std::byte>(i & 0xff));
    data.push_back(static_cast<std::byte>(i >> 8));
  }
  const Bytes bytes = safetensors_bytes(R"({"h":{"dtype":"F16","shape":[65536],"data_offsets":[0,131072]}})", data);
  const Tensor t = std::move(mha::parse_safetensors(bytes, "x", DType::Float64).tensors.at("h"));
  const double* got = t.data_as<double>();
  std::size_t bad = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const int s = i >> 15, e = (i >> 10) & 31, m = i & 1023;
    double expected;
    if (e == 31) expected = m ? kNaN : kInf;
    else if (e == 0) expected = std::ldexp(m / 1024.0, -14);
    else expected = std::ldexp(1.0 + m / 1024.0, e - 15);
    if (s) expected = -expected;
    const bool ok = std::isnan(expected) ? std::isnan(got[i])
                                         : (got[i] == expected && std::signbit(got[i]) == std::signbit(expected));
    if (!ok && bad++ < 5) ADD_FAILURE() << "bits " << i << ": got " << got[i] << ", expected " << expected;
  }
  EXPECT_EQ(bad, 0u);
}

TEST(IoSafetensors, WriterRefusesBadNames) {
  const Tensor t = make_tensor(DType::Float32, {1}, {1});
  EXPECT_THROW(mha::serialize_safetensors({{"__metadata__", t}}), mha::Error);
  EXPECT_THROW(mha::serialize_safetensors({{"bad \xff", t}}), mha::Error);
  EXPECT_THROW(mha::serialize_safetensors({{"t", t}}, {{"k", "bad \xc0\xaf"}}), mha::Error);
}

TEST(IoSafetensors, FileErrorsNameThePath) {
  TempDir dir("st_errors");
  for (const std::string& path : {dir / "missing.safetensors", dir.path().string()}) {
    try {
      mha::read_safetensors(path);
      FAIL() << path << " accepted";
    } catch (const mha::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(path + ": cannot open", 0), 0u) << e.what();
    }
  }
  const Tensor t = make_tensor(DType::Float32, {1}, {1});
  const std::string unwritable = dir / "no_such_dir/out.safetensors";
  try {
    mha::write_safetensors(unwritable, {{"t", t}});
    FAIL() << "wrote into a missing directory";
  } catch (const mha::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(unwritable + ": cannot write", 0), 0u) << e.what();
  }
}

// ---- npy -----------------------------------------------------------------------------------------

TEST(IoNpy, RoundTripEveryDtypeAndRank) {
  TempDir dir("npy_round_trip");
  std::uint64_t seed = 100;
  for (DType dtype : kDTypes)
    for (const Shape& shape : kShapes) {
      SCOPED_TRACE(std::string(mha::dtype_name(dtype)) + " " + mha::shape_str(shape));
      const Tensor t = sample(dtype, shape, seed++);
      const std::string path = dir / "t.npy";
      mha::write_npy(path, t);
      const Bytes bytes = read_file(path);
      EXPECT_TRUE(bytes == mha::serialize_npy(t));
      ASSERT_GE(bytes.size(), 10u);
      const std::size_t header_length =
          std::to_integer<std::size_t>(bytes[8]) + 256 * std::to_integer<std::size_t>(bytes[9]);
      EXPECT_EQ((10 + header_length) % 64, 0u) << "data not 64-byte aligned";
      EXPECT_EQ(static_cast<char>(bytes[10 + header_length - 1]), '\n');
      EXPECT_TRUE(bitwise_equal(mha::read_npy(path), t));
    }
}

TEST(IoNpy, HeaderIsWhatNumPyWrites) {
  const Tensor t = make_tensor(DType::Float32, {2, 3}, {1, 2, 3, 4, 5, 6});
  const std::string text = to_string(mha::serialize_npy(t));
  EXPECT_EQ(text.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  EXPECT_EQ(text.find("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }  "), 10u);
  EXPECT_EQ(text.size(), 128u + 24u);
  const Tensor v = make_tensor(DType::Bool, {4}, {1, 0, 0, 1});
  EXPECT_NE(to_string(mha::serialize_npy(v)).find("{'descr': '|b1', 'fortran_order': False, 'shape': (4,), }"),
            std::string::npos);
  const Tensor s = make_tensor(DType::Float64, {}, {2.5});
  EXPECT_NE(to_string(mha::serialize_npy(s)).find("'shape': (), }"), std::string::npos);
}

TEST(IoNpy, StridedViewsAreWrittenInCOrder) {
  const Tensor t = make_tensor(DType::Float32, {2, 3}, {1, 2, 3, 4, 5, 6});
  const TensorView transposed(t.data(), DType::Float32, {3, 2}, {1, 3});
  EXPECT_EQ(to_doubles(mha::parse_npy(mha::serialize_npy(transposed), "x")), (std::vector<double>{1, 4, 2, 5, 3, 6}));
}

TEST(IoNpy, ReadsVersions2And3AndOldHeaderStyles) {
  const Bytes data = elements<float>({1, 2, 3, 4, 5, 6});
  const std::vector<std::string> headers = {
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2, 3)}",         // double quotes, no trailing comma
      "{'shape': (2,3), 'fortran_order': False, 'descr': '<f4'}      ",            // any key order
      "{\n  'descr': '<f4',\n  'fortran_order': False,\n  'shape': (2L, 3L),\n}",  // Python 2's longs
  };
  for (const auto& h : headers)
    for (int major : {1, 2, 3}) {
      SCOPED_TRACE(h + " version " + std::to_string(major));
      const Tensor t = mha::parse_npy(npy_bytes(h, data, major), "x");
      EXPECT_EQ(t.shape(), (Shape{2, 3}));
      EXPECT_EQ(to_doubles(t), (std::vector<double>{1, 2, 3, 4, 5, 6}));
    }
}

TEST(IoNpy, FortranOrderIsConvertedToCOrder) {
  // a[i][j][k] = 100 i + 10 j + k for shape (2, 3, 4), stored with i fastest.
  Bytes data;
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 2; ++i) data = cat({data, le<double>(100 * i + 10 * j + k)});
  const Tensor t =
      mha::parse_npy(npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3, 4), }", data), "x");
  ASSERT_EQ(t.shape(), (Shape{2, 3, 4}));
  std::vector<double> expected;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) expected.push_back(100 * i + 10 * j + k);
  EXPECT_EQ(to_doubles(t), expected);
}

TEST(IoNpy, Float16IsReadAsFloat32) {
  const Tensor t = mha::parse_npy(npy_bytes("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }",
                                            elements<std::uint16_t>({0x3c00, 0xc000, 0x0001, 0x7c00})),
                                  "x");
  EXPECT_EQ(t.dtype(), DType::Float32);
  EXPECT_EQ(to_doubles(t), (std::vector<double>{1.0, -2.0, std::ldexp(1.0, -24), kInf}));
}

TEST(IoNpy, FileErrorsNameThePath) {
  TempDir dir("npy_errors");
  const std::string path = dir / "missing.npy";
  try {
    mha::read_npy(path);
    FAIL();
  } catch (const mha::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path + ": cannot open", 0), 0u) << e.what();
  }
}

// ---- a MultiHeadAttention layer -------------------------------------------------------------------

struct LayerCase {
  const char* name;
  MultiHeadAttentionConfig config;
};

void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

MultiHeadAttentionConfig config(std::int64_t E, std::int64_t h, std::int64_t d_k = 0, std::int64_t d_v = 0,
                                std::int64_t kdim = 0, std::int64_t vdim = 0) {
  MultiHeadAttentionConfig c;
  c.d_model = E, c.num_heads = h, c.d_k = d_k, c.d_v = d_v, c.kdim = kdim, c.vdim = vdim;
  return c;
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> cases;
  cases.push_back({"packed_E12_h3", config(12, 3)});
  auto c = config(12, 3, 4, 6, 5, 7);
  c.add_bias_kv = true, c.add_zero_attn = true;
  cases.push_back({"separate_kdim5_vdim7_dk4_dv6_bias_kv_zero_attn", c});
  c = config(8, 2);
  c.bias = false, c.batch_first = false, c.dropout = 0.1;
  cases.push_back({"nobias_seq_first_dropout", c});
  c = config(16, 4);
  c.dtype = DType::Float64, c.add_bias_kv = true;
  cases.push_back({"f64_bias_kv", c});
  return cases;
}

class IoLayer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(IoLayer, SaveLoadRoundTrip) {
  const MultiHeadAttentionConfig& c = GetParam().config;
  TempDir dir("layer");
  const std::string path = dir / "layer.safetensors";
  MultiHeadAttention layer(c, /*seed=*/7);
  {  // biases start at zero; give them values so that they are checked too
    Rng rng(3);
    for (const auto& name : layer.parameter_names())
      layer.set_parameter(name, random_tensor(c.dtype, layer.parameter(name).shape(), rng));
  }
  mha::save_safetensors(layer, path);

  MultiHeadAttention loaded = mha::load_multi_head_attention(path);
  const auto& a = layer.config();
  const auto& b = loaded.config();
  EXPECT_EQ(std::tie(a.d_model, a.num_heads, a.d_k, a.d_v, a.kdim, a.vdim, a.bias, a.add_bias_kv, a.add_zero_attn,
                     a.batch_first, a.dropout, a.dtype),
            std::tie(b.d_model, b.num_heads, b.d_k, b.d_v, b.kdim, b.vdim, b.bias, b.add_bias_kv, b.add_zero_attn,
                     b.batch_first, b.dropout, b.dtype));
  ASSERT_EQ(loaded.parameter_names(), layer.parameter_names());
  for (const auto& name : layer.parameter_names())
    EXPECT_TRUE(bitwise_equal(loaded.parameter(name), layer.parameter(name))) << name;

  // The file is a plain safetensors file with the state_dict names and the config as metadata.
  const auto file = mha::read_safetensors(path);
  EXPECT_EQ(file.metadata.at("format"), "mha");
  EXPECT_EQ(file.metadata.at("num_heads"), std::to_string(c.num_heads));
  EXPECT_EQ(file.tensors.size(), layer.parameter_names().size());

  Rng rng(11);
  const std::int64_t B = 2, L = 3, S = 4;
  const auto shape = [&](std::int64_t T, std::int64_t width) {
    return a.batch_first ? Shape{B, T, width} : Shape{T, B, width};
  };
  const Tensor q = random_tensor(c.dtype, shape(L, a.d_model), rng);
  const Tensor k = random_tensor(c.dtype, shape(S, a.kdim), rng);
  const Tensor v = random_tensor(c.dtype, shape(S, a.vdim), rng);
  layer.eval();
  loaded.eval();
  const auto out_a = layer.forward(q, k, v);
  const auto out_b = loaded.forward(q, k, v);
  EXPECT_TRUE(bitwise_equal(out_a.out, out_b.out));
  EXPECT_TRUE(bitwise_equal(out_a.weights, out_b.weights));
}

INSTANTIATE_TEST_SUITE_P(Configs, IoLayer, ::testing::ValuesIn(layer_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return std::string(info.param.name); });

TEST(IoLayerConfig, FileWithoutOurMetadataNeedsAConfig) {
  TempDir dir("layer_config");
  const std::string path = dir / "torch_style.safetensors";
  const MultiHeadAttention layer(config(8, 2), 5);
  mha::write_safetensors(path, layer.state_dict(), {{"format", "pt"}});
  try {
    mha::load_multi_head_attention(path);
    FAIL() << "loaded without a config";
  } catch (const mha::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path + ": __metadata__ holds no MultiHeadAttention config", 0), 0u)
        << e.what();
  }
  auto c = config(8, 2);
  c.dtype = DType::Float64;  // loading converts to the config's dtype
  const MultiHeadAttention loaded = mha::load_multi_head_attention(path, c);
  EXPECT_EQ(loaded.config().dtype, DType::Float64);
  for (const auto& name : layer.parameter_names())
    EXPECT_EQ(to_doubles(loaded.parameter(name)), to_doubles(layer.parameter(name))) << name;
}

TEST(IoLayerConfig, MismatchesAreRefusedNamingTheFile) {
  TempDir dir("layer_mismatch");
  const MultiHeadAttention layer(config(8, 2), 5);
  const std::string path = dir / "layer.safetensors";
  mha::save_safetensors(layer, path);
  const auto expect_error = [&](const std::string& file, const std::optional<MultiHeadAttentionConfig>& c,
                                const std::string& expected) {
    try {
      mha::load_multi_head_attention(file, c);
      ADD_FAILURE() << file << " loaded";
    } catch (const mha::Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(file + ": ", 0), 0u) << message;
      EXPECT_NE(message.find(expected), std::string::npos) << message;
    }
  };
  expect_error(path, config(12, 3), "expected shape");
  expect_error(path, config(8, 3), "d_model");  // the layer refuses the config itself

  // Edited metadata and tensors.
  auto state = layer.state_dict();
  const Tensor extra = make_tensor(DType::Float32, {1}, {0});
  const auto with = [&](std::map<std::string, TensorView> tensors, std::map<std::string, std::string> metadata,
                        const std::string& name) {
    const std::string file = dir / name;
    mha::write_safetensors(file, tensors, metadata);
    return file;
  };
  auto metadata = mha::read_safetensors(path).metadata;
  auto bad = metadata;
  bad["num_heads"] = "two";
  expect_error(with(state, bad, "bad_heads.safetensors"), std::nullopt, "num_heads must be an integer");
  bad = metadata;
  bad.erase("d_k");
  expect_error(with(state, bad, "no_dk.safetensors"), std::nullopt, "missing 'd_k'");
  bad = metadata;
  bad["bias"] = "yes";
  expect_error(with(state, bad, "bad_bias.safetensors"), std::nullopt, "bias must be true or false");
  bad = metadata;
  bad["dropout"] = "1.5";
  expect_error(with(state, bad, "bad_dropout.safetensors"), std::nullopt, "dropout");
  auto more = state;
  more.emplace("extra", extra.view());
  expect_error(with(more, metadata, "extra.safetensors"), std::nullopt, "extra");
  auto fewer = state;
  fewer.erase("out_proj.bias");
  expect_error(with(fewer, metadata, "missing.safetensors"), std::nullopt, "missing parameter 'out_proj.bias'");
}

// ---- PyTorch and NumPy ----------------------------------------------------------------------------

const char* python() {
  const char* p = std::getenv("MHA_PYTHON");
  return p ? p : "/usr/bin/python3";
}

// tests/data/torch_interop.py, found from this file (tests/cpp/io/).
fs::path interop_script() {
  return fs::path(__FILE__).parent_path().parent_path().parent_path() / "data" / "torch_interop.py";
}

// Runs the interop script with `args`; skips the test when Python with torch and numpy is missing.
bool run_interop(const std::string& args) {
  const std::string probe = std::string(python()) + " -c 'import torch, numpy' >/dev/null 2>&1";
  if (std::system(probe.c_str()) != 0) return false;
  const std::string command = std::string(python()) + " " + interop_script().string() + " " + args;
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return true;
}

// Files written by PyTorch (a state_dict in safetensors, written by hand as the safetensors package
// does, which Debian lacks) and by NumPy's np.save, read here.
TEST(IoTorch, ReadsFilesWrittenByPyTorchAndNumPy) {
  TempDir dir("torch_write");
  if (!run_interop("write " + dir.path().string())) GTEST_SKIP() << python() << " with torch and numpy not found";
  if (HasFailure()) return;
  const auto in = [&](const std::string& name) { return mha::read_npy(dir / name); };

  // The torch layer (E 16, h 4, add_bias_kv, batch_first) from its state_dict; forward must match.
  {
    auto c = config(16, 4);
    c.add_bias_kv = true;
    MultiHeadAttention layer = mha::load_multi_head_attention(dir / "packed.safetensors", c);
    layer.eval();
    const auto out = layer.forward(in("packed_q.npy"), in("packed_k.npy"), in("packed_v.npy"));
    EXPECT_TRUE(all_close(to_doubles(out.out), to_doubles(in("packed_out.npy")), 1e-5, 1e-5));
    EXPECT_TRUE(all_close(to_doubles(out.weights), to_doubles(in("packed_weights.npy")), 1e-6, 1e-5));
  }
  // Separate projections (kdim 5, vdim 7), no bias, sequence first.
  {
    auto c = config(12, 3, 0, 0, 5, 7);
    c.bias = false, c.batch_first = false;
    MultiHeadAttention layer = mha::load_multi_head_attention(dir / "separate.safetensors", c);
    layer.eval();
    const auto out = layer.forward(in("separate_q.npy"), in("separate_k.npy"), in("separate_v.npy"));
    EXPECT_TRUE(all_close(to_doubles(out.out), to_doubles(in("separate_out.npy")), 1e-5, 1e-5));
  }
  // float16 and bfloat16 from torch, against torch's own conversion to float32: BF16 is read as
  // bfloat16 (its own dtype) by default, and as float32 when asked.
  {
    const auto file = mha::read_safetensors(dir / "halves.safetensors");
    EXPECT_TRUE(bitwise_equal(file.tensors.at("f16"), in("f16_as_f32.npy")));
    EXPECT_EQ(file.tensors.at("bf16").dtype(), DType::BFloat16);
    EXPECT_TRUE(bitwise_equal(Tensor::copy_of(file.tensors.at("bf16"), DType::Float32), in("bf16_as_f32.npy")));
    const auto as_f32 = mha::read_safetensors(dir / "halves.safetensors", DType::Float32);
    EXPECT_TRUE(bitwise_equal(as_f32.tensors.at("bf16"), in("bf16_as_f32.npy")));
  }
  // np.save / write_array variants against the same values saved plainly.
  for (const char* name : {"fortran_f8", "v2_f4", "v3_f4", "bool", "scalar_f8", "empty_f4", "f2"}) {
    SCOPED_TRACE(name);
    const Tensor t = in(std::string(name) + ".npy");
    const Tensor expected = in(std::string(name) + "_expected.npy");
    EXPECT_TRUE(bitwise_equal(t, expected));
  }
}

// Files written here, read by NumPy (np.load) and by a strict Python safetensors reader that loads
// the state_dict into torch.nn.MultiheadAttention and compares the forward with ours.
TEST(IoTorch, PyTorchAndNumPyReadOurFiles) {
  TempDir dir("torch_check");
  auto c = config(16, 4);
  c.add_bias_kv = true;
  MultiHeadAttention layer(c, 21);
  Rng rng(5);
  for (const auto& name : layer.parameter_names())
    layer.set_parameter(name, random_tensor(DType::Float32, layer.parameter(name).shape(), rng, -0.5, 0.5));
  layer.eval();
  const Tensor q = random_tensor(DType::Float32, {2, 5, 16}, rng);
  const Tensor k = random_tensor(DType::Float32, {2, 7, 16}, rng);
  const Tensor v = random_tensor(DType::Float32, {2, 7, 16}, rng);
  const auto out = layer.forward(q, k, v);
  mha::save_safetensors(layer, dir / "layer.safetensors");
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}, std::pair{"out", &out.out},
                         std::pair{"weights", &out.weights}})
    mha::write_npy(dir / (std::string(name) + ".npy"), *t);
  // Values the script recomputes: arange patterns in every dtype and rank.
  for (DType dtype : kDTypes)
    for (std::size_t i = 0; i < std::size(kShapes); ++i) {
      const Shape& shape = kShapes[i];
      std::vector<double> values;
      for (std::int64_t j = 0; j < mha::shape_numel(shape); ++j)
        values.push_back(dtype == DType::Bool ? static_cast<double>(j % 3 == 0) : j * 0.5 - 1);
      mha::write_npy(dir / ("arange_" + std::string(mha::dtype_name(dtype)) + "_" + std::to_string(i) + ".npy"),
                     make_tensor(dtype, shape, values));
    }
  if (!run_interop("check " + dir.path().string())) GTEST_SKIP() << python() << " with torch and numpy not found";
}

}  // namespace
}  // namespace mha_test
