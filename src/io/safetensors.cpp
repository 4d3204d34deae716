// safetensors: reading (a strict, streaming parse of the header, safetensors_header.hpp, then checked
// reads of each tensor) and writing. Format: https://github.com/huggingface/safetensors (see
// include/mha/io.hpp).
#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "io/binary_file.hpp"
#include "io/little_endian.hpp"
#include "io/safetensors_header.hpp"
#include "io/tensor_bytes.hpp"
#include "io/utf8.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"

namespace mha {

namespace {

using io::Entry;
using io::fail;
using io::HeaderHandler;
using io::kMetadataKey;
using io::printable;
using io::StoredType;

// The reference implementation's limit on the header (MAX_HEADER_SIZE in safetensors/src/tensor.rs).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::uint64_t kLengthBytes = 8;  // the little-endian header length in front of the header

struct DTypeName {
  const char* name;
  StoredType type;
};
constexpr DTypeName kReadable[] = {{"F64", StoredType::F64},
                                   {"F32", StoredType::F32},
                                   {"F16", StoredType::F16},
                                   {"BF16", StoredType::BF16},
                                   {"BOOL", StoredType::Bool}};
// dtypes the format defines that this reader does not convert; named so the message can say so.
constexpr const char* kUnsupported[] = {"I8",  "U8",      "I16",     "U16",     "I32",     "U32",     "I64", "U64",
                                        "C64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};

StoredType stored_type(const Entry& e, const std::string& file) {
  for (const auto& d : kReadable)
    if (e.dtype == d.name) return d.type;
  const std::string prefix = "tensor " + printable(e.name) + ": ";
  for (const char* d : kUnsupported)
    if (e.dtype == d)
      fail(file, prefix + "unsupported dtype " + printable(e.dtype) + " (this reader takes F64, F32, F16, BF16, BOOL)");
  fail(file, prefix + "unknown dtype " + printable(e.dtype));
}

std::string offsets_str(std::uint64_t begin, std::uint64_t end) {
  std::string s = "[";  // built step by step: "[" + std::string&& trips GCC 12's -Wrestrict (bug 105329)
  s += std::to_string(begin);
  s += ", ";
  s += std::to_string(end);
  return s + "]";
}

// The header's JSON text, after checking its length against the file, its UTF-8 and the absence of NUL.
std::string read_header_text(const io::ByteSource& source) {
  const std::string& file = source.name();
  if (source.size() < kLengthBytes)
    fail(file, "the file is " + std::to_string(source.size()) + " bytes, shorter than the 8-byte header length");

  std::byte length_bytes[kLengthBytes];
  source.read(0, length_bytes, kLengthBytes);
  const auto header_length = io::load_le<std::uint64_t>(length_bytes);
  if (header_length > source.size() - kLengthBytes) {  // what a file of another kind usually gives
    if (const std::string kind = io::apparent_kind(source); !kind.empty() && kind != "a safetensors file")
      fail(file, "not a safetensors file: it appears to be " + kind +
                     " (a safetensors file starts with the 8-byte length of its JSON header)");
  }
  if (header_length > kMaxHeaderBytes)
    fail(file, "header length " + std::to_string(header_length) + " exceeds the limit of " +
                   std::to_string(kMaxHeaderBytes) + " bytes");
  if (header_length > source.size() - kLengthBytes)
    fail(file, "header length " + std::to_string(header_length) + " runs past the end of the file (" +
                   std::to_string(source.size()) + " bytes)");

  std::string header(header_length, '\0');
  source.read(kLengthBytes, header.data(), header.size());
  if (const auto bad = io::first_invalid_utf8(header))
    fail(file, "header is not valid UTF-8 (byte " + std::to_string(*bad) + " of the header)");

  // nlohmann's lexer takes a NUL byte for the end of the input (for C strings), so "{}\0junk" would
  // pass; JSON allows no raw NUL anywhere, so refuse it first.
  if (const auto nul = header.find('\0'); nul != std::string::npos)
    fail(file, "header is not valid JSON: a NUL byte at byte " + std::to_string(nul) + " of the header");
  return header;
}

// Each tensor's own description: a unique name, a dtype, a size, offsets inside the data buffer
// (buffer_size bytes) that match the size. Returns the stored type of each entry.
std::vector<StoredType> check_entries(const std::vector<Entry>& entries, const std::string& file,
                                      std::uint64_t buffer_size) {
  // Names must be unique (a JSON object may repeat a key; nlohmann would keep the last silently).
  // Checked on sorted indices rather than with a set, so the names are not stored twice.
  std::vector<std::size_t> order(entries.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return entries[a].name < entries[b].name; });
  for (std::size_t i = 1; i < order.size(); ++i)
    if (entries[order[i]].name == entries[order[i - 1]].name)
      fail(file, "duplicate tensor name " + printable(entries[order[i]].name));

  std::vector<StoredType> types;
  types.reserve(entries.size());
  for (const Entry& e : entries) {
    const std::string prefix = "tensor " + printable(e.name) + ": ";
    const StoredType type = stored_type(e, file);
    types.push_back(type);
    const auto bytes = io::checked_byte_size(e.shape, io::stored_size(type));
    if (!bytes) fail(file, prefix + "shape " + shape_str(e.shape) + " is too large: its byte size overflows 64 bits");
    const std::uint64_t begin = e.offsets[0], end = e.offsets[1];
    if (begin > end) fail(file, prefix + "data_offsets " + offsets_str(begin, end) + " are reversed");
    if (end > buffer_size)
      fail(file, prefix + "data_offsets " + offsets_str(begin, end) + " run past the end of the data buffer (" +
                     std::to_string(buffer_size) + " bytes; is the file truncated?)");
    if (end - begin != *bytes)
      fail(file, prefix + "data_offsets " + offsets_str(begin, end) + " hold " + std::to_string(end - begin) +
                     " bytes, but " + e.dtype + " " + shape_str(e.shape) + " needs " + std::to_string(*bytes));
  }
  return types;
}

// Together the tensors must tile the data buffer: sorted by offset, each begins where the last ended.
void check_buffer_tiling(const std::vector<Entry>& entries, const std::string& file, std::uint64_t buffer_size) {
  std::vector<std::size_t> order(entries.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return entries[a].offsets < entries[b].offsets; });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (std::size_t i : order) {
    const Entry& e = entries[i];
    if (e.offsets[0] < covered)
      fail(file, "tensor " + printable(e.name) + " (data_offsets " + offsets_str(e.offsets[0], e.offsets[1]) +
                     ") overlaps tensor " + printable(previous->name) + " (data_offsets " +
                     offsets_str(previous->offsets[0], previous->offsets[1]) + ")");
    if (e.offsets[0] > covered)
      fail(file, "bytes " + offsets_str(covered, e.offsets[0]) +
                     " of the data buffer belong to no tensor (a gap before tensor " + printable(e.name) + ")");
    covered = e.offsets[1];
    previous = &e;
  }
  if (covered != buffer_size)
    fail(file, "the last " + std::to_string(buffer_size - covered) + " bytes of the data buffer (" +
                   std::to_string(buffer_size) + " bytes) belong to no tensor");
}

SafetensorsFile read_from(const io::ByteSource& source, std::optional<DType> dtype) {
  const std::string& file = source.name();
  if (dtype && *dtype == DType::Bool)
    fail(file, "dtype: floating-point tensors are read as float32, float64 or bfloat16, not bool");
  std::string header = read_header_text(source);
  const std::uint64_t data_start = kLengthBytes + header.size();

  HeaderHandler handler;
  const bool parsed = nlohmann::json::sax_parse(header.data(), header.data() + header.size(), &handler);
  if (!parsed || !handler.done())
    fail(file, handler.error.empty() ? std::string("header is not valid JSON") : handler.error);
  header = std::string();  // the header's text is no longer needed
  const auto& entries = handler.entries;

  const std::uint64_t buffer_size = source.size() - data_start;
  const std::vector<StoredType> types = check_entries(entries, file, buffer_size);
  check_buffer_tiling(entries, file, buffer_size);

  // Only now, with every size checked against the file, is anything allocated for the data.
  SafetensorsFile result;
  result.metadata = std::move(handler.metadata);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const DType target = types[i] == StoredType::Bool ? DType::Bool : dtype.value_or(io::natural_dtype(types[i]));
    result.tensors.emplace(e.name, io::read_elements(source, data_start + e.offsets[0], types[i], e.shape, target));
  }
  return result;
}

// ---- writing -------------------------------------------------------------------------------------

const char* stored_name(DType dtype) {
  switch (dtype) {
    case DType::Float64: return "F64";
    case DType::Float32: return "F32";
    case DType::Bool: return "BOOL";
    case DType::BFloat16: return "BF16";
  }
  return "?";
}

void check_utf8(const std::string& file, const std::string& what, const std::string& text) {
  if (io::first_invalid_utf8(text)) fail(file, what + " " + printable(text) + " is not valid UTF-8");
}

// Writes the whole file to `sink`; `file` names it in error messages.
void write_to(io::ByteSink& sink, const std::string& file, const std::map<std::string, TensorView>& tensors,
              const std::map<std::string, std::string>& metadata) {
  // Layout order: wider elements first, then by name, so each tensor starts aligned to its element.
  std::vector<const std::pair<const std::string, TensorView>*> order;
  for (const auto& item : tensors) {
    if (item.first == kMetadataKey) fail(file, "a tensor cannot be named \"__metadata__\"");
    check_utf8(file, "tensor name", item.first);
    order.push_back(&item);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](auto* a, auto* b) { return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype()); });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = header[kMetadataKey] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) {
      check_utf8(file, "metadata key", key);
      check_utf8(file, "metadata value of " + printable(key), value);
      m[key] = value;
    }
  }
  std::uint64_t offset = 0;
  for (const auto* item : order) {
    const TensorView& view = item->second;
    const std::uint64_t bytes = static_cast<std::uint64_t>(view.numel()) * dtype_size(view.dtype());
    header[item->first] = {
        {"dtype", stored_name(view.dtype())}, {"shape", view.shape()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the buffer then starts 8-byte aligned

  std::byte length[kLengthBytes];
  io::store_le<std::uint64_t>(length, text.size());
  sink.write(length, sizeof length);
  sink.write(text.data(), text.size());
  for (const auto* item : order) io::write_c_order(sink, item->second);
}

}  // namespace

SafetensorsFile read_safetensors(const std::string& path, std::optional<DType> dtype) {
  return read_from(io::FileSource(path), dtype);
}

SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, const std::string& name,
                                  std::optional<DType> dtype) {
  return read_from(io::MemorySource(bytes, name), dtype);
}

void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  io::FileSink sink(path);
  write_to(sink, path, tensors, metadata);
  sink.commit();
}

std::vector<std::byte> serialize_safetensors(const std::map<std::string, TensorView>& tensors,
                                             const std::map<std::string, std::string>& metadata) {
  io::VectorSink sink;
  write_to(sink, "serialize_safetensors", tensors, metadata);
  return std::move(sink.bytes);
}

}  // namespace mha
