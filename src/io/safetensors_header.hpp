// The safetensors header's parser: nlohmann/json's SAX interface driving a handler that accepts
// exactly the structure safetensors allows, rather than a parse into a json value. It stops at the
// first surprise (so nesting depth, value kinds and duplicate keys, which json::parse would silently
// let through, are all checked), and nothing is built but the tensor table itself. Used by
// safetensors.cpp, which then checks each entry against the file.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/binary_file.hpp"
#include "mha/tensor.hpp"

namespace mha::io {

inline constexpr const char* kMetadataKey = "__metadata__";

// One tensor as the header describes it, before the description is checked against the buffer.
struct Entry {
  std::string name;
  std::string dtype;
  Shape shape;
  std::array<std::uint64_t, 2> offsets{};  // [begin, end) relative to the data buffer
  std::size_t offsets_count = 0;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// Accepts exactly: { name: {"dtype": str, "shape": [uint...], "data_offsets": [uint, uint]} ...,
// "__metadata__": {str: str} or null }. Each callback returns false (stopping the parse) with a
// message in `error` at the first event that does not fit.
class HeaderHandler {
 public:
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
  std::string error;

  bool null() { return value("null"); }
  bool boolean(bool) { return value("a boolean"); }
  bool number_integer(std::int64_t v) {  // nlohmann reports only negative integers here
    if (state_ == State::kShapeItem) return refuse(where() + "shape has a negative size " + std::to_string(v));
    return value("the negative integer " + std::to_string(v));
  }
  bool number_unsigned(std::uint64_t v) {
    if (state_ == State::kShapeItem) {
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return refuse(where() + "shape size " + std::to_string(v) + " does not fit 64-bit sizes");
      entries.back().shape.push_back(static_cast<std::int64_t>(v));
      return true;
    }
    if (state_ == State::kOffsetsItem) {
      Entry& e = entries.back();
      if (e.offsets_count == 2) return refuse(where() + "data_offsets must be two integers [begin, end], got more");
      e.offsets[e.offsets_count++] = v;
      return true;
    }
    return value("the integer " + std::to_string(v));
  }
  bool number_float(double, const std::string& text) {
    // Also where integers too large for 64 bits land.
    return value("the number " + printable(text, 40) + " (not an integer that fits 64 bits)");
  }
  bool string(std::string& s) {
    switch (state_) {
      case State::kDtype:
        entries.back().dtype = std::move(s);
        state_ = State::kEntryKey;
        return true;
      case State::kMetadataValue:
        metadata[metadata_key_] = std::move(s);
        state_ = State::kMetadataKey;
        return true;
      default: return value("a string");
    }
  }
  bool binary(nlohmann::json::binary_t&) { return value("binary data"); }

  bool start_object(std::size_t) {
    switch (state_) {
      case State::kTop: state_ = State::kTopKey; return true;
      case State::kEntryValue: state_ = State::kEntryKey; return true;
      case State::kMetadataStart: state_ = State::kMetadataKey; return true;
      default: return value("an object");
    }
  }
  bool end_object() {
    switch (state_) {
      case State::kTopKey: state_ = State::kDone; return true;
      case State::kMetadataKey: state_ = State::kTopKey; return true;
      case State::kEntryKey: {
        const Entry& e = entries.back();
        for (auto [present, key] : {std::pair{e.has_dtype, "dtype"}, std::pair{e.has_shape, "shape"},
                                    std::pair{e.has_offsets, "data_offsets"}})
          if (!present) return refuse(where() + "missing \"" + key + "\"");
        state_ = State::kTopKey;
        return true;
      }
      default: return refuse("malformed header");  // unreachable: the parser pairs braces
    }
  }
  bool key(std::string& k) {
    switch (state_) {
      case State::kTopKey:
        if (k == kMetadataKey) {
          if (seen_metadata_) return refuse("duplicate key \"__metadata__\"");
          seen_metadata_ = true;
          state_ = State::kMetadataStart;
          return true;
        }
        entries.push_back(Entry{});  // duplicate names are found after the parse (see read_from)
        entries.back().name = std::move(k);
        state_ = State::kEntryValue;
        return true;
      case State::kEntryKey: {
        Entry& e = entries.back();
        bool* seen = k == "dtype"          ? &e.has_dtype
                     : k == "shape"        ? &e.has_shape
                     : k == "data_offsets" ? &e.has_offsets
                                           : nullptr;
        if (!seen) return refuse(where() + "unknown key " + printable(k) + " (expected dtype, shape, data_offsets)");
        if (*seen) return refuse(where() + "duplicate key " + printable(k));
        *seen = true;
        state_ = k == "dtype" ? State::kDtype : k == "shape" ? State::kShapeStart : State::kOffsetsStart;
        return true;
      }
      case State::kMetadataKey:
        if (metadata.count(k)) return refuse("__metadata__: duplicate key " + printable(k));
        metadata_key_ = std::move(k);
        state_ = State::kMetadataValue;
        return true;
      default: return refuse("malformed header");  // unreachable: keys come only inside objects
    }
  }
  bool start_array(std::size_t) {
    switch (state_) {
      case State::kShapeStart: state_ = State::kShapeItem; return true;
      case State::kOffsetsStart: state_ = State::kOffsetsItem; return true;
      default: return value("an array");
    }
  }
  bool end_array() {
    if (state_ == State::kOffsetsItem && entries.back().offsets_count != 2)
      return refuse(where() + "data_offsets must be two integers [begin, end], got " +
                    std::to_string(entries.back().offsets_count));
    state_ = State::kEntryKey;  // only the shape and offsets arrays are ever opened
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& ex) {
    std::string what = ex.what();
    if (const auto bracket = what.find("] "); what.rfind("[json.exception", 0) == 0 && bracket != std::string::npos)
      what = what.substr(bracket + 2);  // drop nlohmann's "[json.exception.parse_error.101] " prefix
    return refuse("header is not valid JSON: " + what);
  }

  bool done() const { return state_ == State::kDone; }

 private:
  enum class State {
    kTop,
    kTopKey,
    kEntryValue,
    kEntryKey,
    kDtype,
    kShapeStart,
    kShapeItem,
    kOffsetsStart,
    kOffsetsItem,
    kMetadataStart,
    kMetadataKey,
    kMetadataValue,
    kDone
  };

  bool refuse(std::string message) {
    error = std::move(message);
    return false;
  }
  std::string where() const { return "tensor " + printable(entries.back().name) + ": "; }

  // A value of kind `got` arrived in `state_`: accept a null "__metadata__", refuse anything else
  // with what was expected there.
  bool value(const std::string& got) {
    switch (state_) {
      case State::kTop: return refuse("header is not a JSON object: it is " + got);
      case State::kEntryValue:
        return refuse(where() + "expected an object {\"dtype\", \"shape\", \"data_offsets\"}, got " + got);
      case State::kDtype: return refuse(where() + "dtype must be a string, got " + got);
      case State::kShapeStart: return refuse(where() + "shape must be an array of non-negative integers, got " + got);
      case State::kShapeItem: return refuse(where() + "shape entries must be non-negative integers, got " + got);
      case State::kOffsetsStart: return refuse(where() + "data_offsets must be two integers [begin, end], got " + got);
      case State::kOffsetsItem:
        return refuse(where() + "data_offsets must be two non-negative integers [begin, end], got " + got);
      case State::kMetadataStart:
        if (got == "null") {
          state_ = State::kTopKey;
          return true;
        }
        return refuse("__metadata__ must be an object of strings, got " + got);
      case State::kMetadataValue:
        return refuse("__metadata__: the value of " + printable(metadata_key_) + " must be a string, got " + got);
      default: return refuse("malformed header: unexpected " + got);
    }
  }

  State state_ = State::kTop;
  bool seen_metadata_ = false;
  std::string metadata_key_;
};

}  // namespace mha::io
