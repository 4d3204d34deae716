// Binds PagedKVCache (mha/paged_kv_cache.hpp) as mha.PagedKVCache. Every method runs with the GIL
// held (they copy at most a few pages), so one cache is never changed by two Python threads at once.
#include "mha/paged_kv_cache.hpp"

#include <cstdint>
#include <string>

#include <pybind11/stl.h>

#include "bindings.hpp"
#include "mha/error.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {
namespace {

// "float32" / numpy.float32 / "float64" / "bfloat16" ... as the cache's DType; anything else is
// refused by name. bfloat16 is named by the string (NumPy has no such dtype) or mha.DType.bfloat16.
DType cache_dtype(const py::object& dtype) {
  constexpr const char* expected = "PagedKVCache: dtype: expected float32, float64 or \"bfloat16\", got ";
  if (py::isinstance<DType>(dtype)) {
    const DType d = dtype.cast<DType>();
    if (d == DType::Bool) throw Error(std::string(expected) + dtype_name(d));
    return d;
  }
  if (py::isinstance<py::str>(dtype) && dtype.cast<std::string>() == "bfloat16") return DType::BFloat16;
  std::string name;
  try {
    name = py::str(py::dtype::from_args(dtype).attr("name"));
  } catch (py::error_already_set&) {  // not a NumPy dtype at all
    throw Error(expected + py::str(py::repr(dtype)).cast<std::string>());
  }
  if (name == "float32") return DType::Float32;
  if (name == "float64") return DType::Float64;
  throw Error(expected + name);
}

PagedKVCache make_cache(std::int64_t num_kv_heads, std::int64_t head_dim, std::int64_t value_dim,
                        std::int64_t page_size, std::int64_t capacity_tokens, const py::object& dtype) {
  return PagedKVCache({.num_kv_heads = num_kv_heads,
                       .head_dim = head_dim,
                       .value_dim = value_dim,
                       .page_size = page_size,
                       .capacity_tokens = capacity_tokens,
                       .dtype = cache_dtype(dtype)});
}

// keys / values viewed in place; float32 / float64 data for a bfloat16 cache is rounded to bfloat16 first
// (NumPy has no bfloat16; a BFloat16Bits is viewed in place).
ArrayView cache_input(const PagedKVCache& cache, py::handle array, const char* name) {
  ArrayView view = view_of(array, name, Accept::Float);
  if (cache.config().dtype != DType::BFloat16) return view;
  return converted_to(std::move(view), DType::BFloat16);
}

void append(PagedKVCache& cache, PagedKVCache::SequenceId sequence, py::handle keys, py::handle values) {
  const ArrayView k = cache_input(cache, keys, "keys"), v = cache_input(cache, values, "values");
  cache.append(sequence, k.view, v.view);
}

}  // namespace

void register_paged_kv_cache(py::module_& m) {
  py::class_<PagedKVCache>(m, "PagedKVCache",
                           "One layer's keys and values for many sequences, in a preallocated pool of pages of\n"
                           "page_size tokens; fork() shares a sequence's pages copy-on-write. A refused call\n"
                           "(unknown sequence, wrong shape or dtype, not enough free pages) raises mha.Error\n"
                           "and changes nothing.")
      .def(py::init(&make_cache), py::arg("num_kv_heads"), py::arg("head_dim"), py::kw_only(), py::arg("value_dim") = 0,
           py::arg("page_size") = 16, py::arg("capacity_tokens"), py::arg("dtype") = py::str("float32"),
           "value_dim 0: head_dim. The pool holds ceil(capacity_tokens / page_size) pages. dtype: float32,\n"
           "float64 or \"bfloat16\" (keys and values stored as bfloat16: float32 / float64 arrays are\n"
           "rounded to nearest even on append, and keys() / values() return float32).")
      .def("add_sequence", &PagedKVCache::add_sequence, "A new, empty sequence; returns its id")
      .def("append", &append, py::arg("sequence"), py::arg("keys"), py::arg("values"),
           "Appends keys [n, num_kv_heads, head_dim] and values [n, num_kv_heads, value_dim]")
      .def("fork", &PagedKVCache::fork, py::arg("sequence"), "A new sequence sharing this one's positions")
      .def("release", &PagedKVCache::release, py::arg("sequence"))
      .def("length", &PagedKVCache::length, py::arg("sequence"))
      .def("__contains__", &PagedKVCache::contains)
      .def_property_readonly("sequences", &PagedKVCache::sequences)
      .def("page_table",
           [](const PagedKVCache& c, PagedKVCache::SequenceId s) {
             const auto table = c.page_table(s);
             return std::vector<std::int32_t>(table.begin(), table.end());
           })
      .def("page_users", &PagedKVCache::page_users, py::arg("page"))
      .def_property_readonly("page_count", &PagedKVCache::page_count)
      .def_property_readonly("pages_in_use", &PagedKVCache::pages_in_use)
      .def_property_readonly("free_pages", &PagedKVCache::free_pages)
      .def(
          "keys", [](const PagedKVCache& c, PagedKVCache::SequenceId s) { return to_numpy(c.keys(s)); },
          "A copy of the sequence's keys [num_kv_heads, length, head_dim] (float32 for a bfloat16 cache)")
      .def(
          "values", [](const PagedKVCache& c, PagedKVCache::SequenceId s) { return to_numpy(c.values(s)); },
          "A copy of the sequence's values [num_kv_heads, length, value_dim] (float32 for a bfloat16 cache)");
}

}  // namespace mha::python
