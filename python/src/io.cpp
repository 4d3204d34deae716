// Binds the file formats (mha/io.hpp): safetensors and .npy, read and written from NumPy arrays.
// Paths may be str, bytes or os.PathLike (arguments.hpp); the writers store float32, float64 and bool
// arrays and refuse every other dtype (an integer array is not silently stored as bool).
#include "mha/io.hpp"

#include <map>
#include <string>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

void register_io(py::module_& m) {
  m.def(
      "read_safetensors",
      [](py::handle path_obj) {
        const std::string path = path_arg(path_obj);
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
      [](py::handle path_obj, const py::dict& tensors, py::handle metadata_obj) {
        const std::string path = path_arg(path_obj);
        const std::map<std::string, std::string> metadata =
            metadata_obj.is_none() ? std::map<std::string, std::string>{} : utf8_dict_arg(metadata_obj, "metadata");
        std::vector<ArrayView> keep;  // the arrays behind the views, alive until written
        keep.reserve(tensors.size());
        std::map<std::string, TensorView> views;
        for (auto [name, value] : tensors) {
          const std::string key = utf8_arg(name, "tensors key");
          keep.push_back(view_of(value, "tensors[" + py::repr(name).cast<std::string>() + "]", Accept::Stored));
          views.emplace(key, keep.back().view);
        }
        py::gil_scoped_release release;
        mha::write_safetensors(path, views, metadata);
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata") = py::none(),
      "Writes {name: array} (float32, float64, bool) and {str: str} metadata as a safetensors file");
  m.def("config_from_metadata", &mha::config_from_metadata, py::arg("metadata"), py::arg("name"),
        "The MultiHeadAttentionConfig in a safetensors file's metadata, as save_safetensors writes it");
  m.def(
      "read_npy", [](py::handle path) { return to_numpy(mha::read_npy(path_arg(path))); }, py::arg("path"));
  m.def(
      "write_npy",
      [](py::handle path, py::handle array) {
        const std::string file = path_arg(path);
        const ArrayView view = view_of(array, "array", Accept::Stored);
        mha::write_npy(file, view.view);
      },
      py::arg("path"), py::arg("array"));
}

}  // namespace mha::python
