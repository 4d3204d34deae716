// Binds PagedKVCache (mha/paged_kv_cache.hpp) as mha.PagedKVCache. The cache's own reader/writer hold
// (the threads contract in its header) keeps it consistent between Python threads: the writers run
// without the GIL, so that a writer waiting for a decode in progress (mha.decode_attention releases the
// GIL) does not stop every other Python thread meanwhile.
#include "mha/paged_kv_cache.hpp"

#include <cstdint>
#include <string>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "mha/error.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {
namespace {

// The cache's DType and KVStorage.
struct CacheDType {
  DType dtype = DType::Float32;
  KVStorage storage = KVStorage::Native;
};

// "float32" / numpy.float32 / "float64" / "bfloat16" ... as the cache's DType, "int8" (or numpy.int8)
// and "float8_e4m3" as float32 with quantized storage; anything else is refused by name. bfloat16 and
// float8_e4m3 are named by the string (NumPy has no such dtypes) or, bfloat16, mha.DType.bfloat16.
CacheDType cache_dtype(const py::object& dtype) {
  const auto refused = [](const std::string& got) {
    return Error("PagedKVCache: dtype: expected float32, float64 or \"bfloat16\", got " + got +
                 " (or, quantized, \"int8\" or \"float8_e4m3\")");
  };
  if (dtype.is_none()) throw refused("None");  // NumPy reads None as float64
  if (py::isinstance<DType>(dtype)) {
    const DType d = dtype.cast<DType>();
    if (d == DType::Bool) throw refused(dtype_name(d));
    return {d};
  }
  if (py::isinstance<py::str>(dtype)) {
    const std::string text = dtype.cast<std::string>();
    if (text == "bfloat16") return {DType::BFloat16};
    if (text == "float8_e4m3") return {DType::Float32, KVStorage::Float8E4M3};
  }
  std::string name;
  try {
    name = py::str(py::dtype::from_args(dtype).attr("name"));
  } catch (py::error_already_set&) {  // not a NumPy dtype at all
    throw refused(py::str(py::repr(dtype)).cast<std::string>());
  }
  if (name == "float32") return {DType::Float32};
  if (name == "float64") return {DType::Float64};
  if (name == "int8") return {DType::Float32, KVStorage::Int8};
  throw refused(name);
}

PagedKVCache make_cache(py::handle num_kv_heads, py::handle head_dim, py::handle value_dim, py::handle page_size,
                        py::handle capacity_tokens, const py::object& dtype) {
  auto size = [](py::handle obj, const char* name) { return int64_arg(obj, std::string("PagedKVCache: ") + name); };
  PagedKVCacheConfig config{.num_kv_heads = size(num_kv_heads, "num_kv_heads"),
                            .head_dim = size(head_dim, "head_dim"),
                            .value_dim = size(value_dim, "value_dim"),
                            .page_size = size(page_size, "page_size"),
                            .capacity_tokens = size(capacity_tokens, "capacity_tokens")};
  const CacheDType stored = cache_dtype(dtype);  // after the sizes, as before: the first bad argument is named
  config.dtype = stored.dtype, config.storage = stored.storage;
  return PagedKVCache(config);
}

// keys / values viewed in place; float32 / float64 data for a bfloat16 cache is rounded to bfloat16 first
// (NumPy has no bfloat16; a BFloat16Bits is viewed in place). A quantized cache takes float32, float64
// and BFloat16Bits in place (PagedKVCache::append quantizes them).
ArrayView cache_input(const PagedKVCache& cache, py::handle array, const char* name) {
  ArrayView view = view_of(array, name, Accept::Float);
  if (cache.config().dtype != DType::BFloat16 || cache.config().storage != KVStorage::Native) return view;
  return converted_to(std::move(view), DType::BFloat16);
}

// A sequence id argument: an int64 (int64_arg), else mha.Error naming `sequence`, never pybind11's
// "incompatible function arguments" TypeError.
PagedKVCache::SequenceId sequence_arg(py::handle obj) { return int64_arg(obj, "sequence"); }

// The method `Method` of the cache called with a sequence id converted by sequence_arg (with the GIL);
// with ReleaseGil (the writers fork and release) the call itself runs without the GIL.
template <auto Method, bool ReleaseGil = false>
auto with_sequence_arg() {
  return [](PagedKVCache& cache, py::handle sequence) {
    const PagedKVCache::SequenceId id = sequence_arg(sequence);
    if constexpr (ReleaseGil) {
      py::gil_scoped_release release;
      return (cache.*Method)(id);
    } else {
      return (cache.*Method)(id);
    }
  };
}

void append(PagedKVCache& cache, py::handle sequence_obj, py::handle keys, py::handle values) {
  const PagedKVCache::SequenceId sequence = sequence_arg(sequence_obj);
  const ArrayView k = cache_input(cache, keys, "keys"), v = cache_input(cache, values, "values");
  py::gil_scoped_release release;  // k and v keep the arrays (or their bfloat16 copies) alive
  cache.append(sequence, k.view, v.view);
}

}  // namespace

void register_paged_kv_cache(py::module_& m) {
  py::class_<PagedKVCache>(m, "PagedKVCache",
                           "One layer's keys and values for many sequences, in a preallocated pool of pages of\n"
                           "page_size tokens; fork() shares a sequence's pages copy-on-write. A refused call\n"
                           "(unknown sequence, wrong shape or dtype, not enough free pages) raises mha.Error\n"
                           "and changes nothing.\n\n"
                           "Threads: one cache may be used from several threads at once. Reads (length,\n"
                           "page_table, keys, values, mha.decode_attention, ...) share it; writes (add_sequence,\n"
                           "append, fork, release) have it alone, waiting until the reads in progress end (a\n"
                           "decode runs without the GIL), and reads wait for a write in progress. Every call\n"
                           "sees the cache before or after a write, never during it.")
      .def(py::init(&make_cache), py::arg("num_kv_heads"), py::arg("head_dim"), py::kw_only(), py::arg("value_dim") = 0,
           py::arg("page_size") = 16, py::arg("capacity_tokens"), py::arg("dtype") = py::str("float32"),
           "value_dim 0: head_dim. The pool holds ceil(capacity_tokens / page_size) pages. dtype: float32,\n"
           "float64 or \"bfloat16\" (keys and values stored as bfloat16: float32 / float64 arrays are\n"
           "rounded to nearest even on append, and keys() / values() return float32); None is refused.\n"
           "dtype \"int8\" or \"float8_e4m3\": quantized storage (the storage property says which): each\n"
           "(token, kv head) row of keys and of values stored as int8 or float8 e4m3 (fn) with a float32\n"
           "scale of its own (about max|row| / 127 or / 448), quantized as it is appended from float32,\n"
           "float64 or BFloat16Bits arrays; keys() / values() return the float32 values read back,\n"
           "float(q) * scale, exactly what mha.decode_attention reads (with float32 or bfloat16 queries).\n"
           "A row holding NaN or +-Inf reads back as NaN throughout; an all-zero row as 0.\n"
           "Sizes are int64 integers; a page or pool larger than a tensor may be raises mha.Error.")
      .def("add_sequence", &PagedKVCache::add_sequence, py::call_guard<py::gil_scoped_release>(),
           "A new, empty sequence; returns its id")
      .def("append", &append, py::arg("sequence"), py::arg("keys"), py::arg("values"),
           "Appends keys [n, num_kv_heads, head_dim] and values [n, num_kv_heads, value_dim]")
      .def("fork", with_sequence_arg<&PagedKVCache::fork, true>(), py::arg("sequence"),
           "A new sequence sharing this one's positions")
      .def("release", with_sequence_arg<&PagedKVCache::release, true>(), py::arg("sequence"))
      .def("length", with_sequence_arg<&PagedKVCache::length>(), py::arg("sequence"))
      .def("__contains__",
           [](const PagedKVCache& c, py::handle sequence) {  // not an int64: no such sequence, as a dict says
             try {
               return c.contains(sequence_arg(sequence));
             } catch (const Error&) {
               return false;
             }
           })
      .def_property_readonly("sequences", &PagedKVCache::sequences)
      .def("page_table",
           [](const PagedKVCache& c, py::handle sequence) {
             const PagedKVCache::SequenceId s = sequence_arg(sequence);
             const PagedKVCache::Hold hold = c.read_hold();  // the span is valid while no writer runs
             const auto table = c.page_table(s);
             return std::vector<std::int32_t>(table.begin(), table.end());
           })
      .def(
          "page_users",
          [](const PagedKVCache& c, py::handle page_obj) {
            const std::int64_t page = int64_arg(page_obj, "page");
            if (page != static_cast<std::int32_t>(page))
              throw Error("PagedKVCache: page " + std::to_string(page) + " does not exist");
            return c.page_users(static_cast<std::int32_t>(page));
          },
          py::arg("page"))
      .def_property_readonly(
          "storage", [](const PagedKVCache& c) { return kv_storage_name(c.config().storage); },
          "\"native\" (elements of the dtype, as appended), \"int8\" or \"float8_e4m3\" (quantized rows)")
      .def_property_readonly("page_count", &PagedKVCache::page_count)
      .def_property_readonly("pages_in_use", &PagedKVCache::pages_in_use)
      .def_property_readonly("free_pages", &PagedKVCache::free_pages)
      .def(
          "keys", [](const PagedKVCache& c, py::handle s) { return to_numpy(c.keys(sequence_arg(s))); },
          "A copy of the sequence's keys [num_kv_heads, length, head_dim] (float32 for a bfloat16 or quantized\n"
          "cache: the values read back)")
      .def(
          "values", [](const PagedKVCache& c, py::handle s) { return to_numpy(c.values(sequence_arg(s))); },
          "A copy of the sequence's values [num_kv_heads, length, value_dim] (float32 for a bfloat16 or\n"
          "quantized cache: the values read back)");
}

}  // namespace mha::python
