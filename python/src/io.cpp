// Binds the file formats (mha/io.hpp): safetensors and .npy, read and written from NumPy arrays.
#include "mha/io.hpp"

#include <map>
#include <string>

#include <pybind11/stl.h>

#include "bindings.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

void register_io(py::module_& m) {
  m.def(
      "read_safetensors",
      [](const std::string& path) {
        SafetensorsFile file;
        {
          py::gil_scoped_release release;
          file = mha::read_safetensors(path);
        }
        py::dict tensors;
        for (auto& [name, tensor] : file.tensors) tensors[py::str(name)] = to_numpy(std::move(tensor));
        return py::make_tuple(tensors, file.metadata);
      },
      py::arg("path"), "Reads a safetensors file: ({name: array}, {metadata key: value})");
  m.def(
      "write_safetensors",
      [](const std::string& path, const py::dict& tensors, const std::map<std::string, std::string>& metadata) {
        std::vector<ArrayView> keep;  // the arrays behind the views, alive until written
        std::map<std::string, TensorView> views;
        for (auto [name, value] : tensors) {
          const std::string key = py::cast<std::string>(name);
          keep.push_back(view_of(value, key, Accept::Mask));
          views.emplace(key, keep.back().view);
        }
        py::gil_scoped_release release;
        mha::write_safetensors(path, views, metadata);
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata") = std::map<std::string, std::string>{},
      "Writes {name: array} (float32, float64, bool) and string metadata as a safetensors file");
  m.def(
      "read_npy", [](const std::string& path) { return to_numpy(mha::read_npy(path)); }, py::arg("path"));
  m.def(
      "write_npy",
      [](const std::string& path, py::handle array) {
        const ArrayView view = view_of(array, "array", Accept::Mask);
        mha::write_npy(path, view.view);
      },
      py::arg("path"), py::arg("array"));
}

}  // namespace mha::python
