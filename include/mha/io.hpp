/// \file
/// File formats: safetensors (Hugging Face) and NumPy's .npy, read and written.
///
/// Readers treat every file as hostile. A file that is not exactly what its format allows is refused
/// with mha::Error naming the file (its path, or the name given to a parse_* call) and the problem, e.g.
///
///     "model.safetensors: tensor 'w': data_offsets [0, 12] hold 12 bytes, but F32 [2, 3] needs 24".
///
/// Every size a file states is checked against the bytes the file actually has before anything is
/// allocated, and a reader never reads outside the file. What a reader allocates is bounded by what
/// the file holds, never by what it claims: the tensors (at most the data's size; twice it when F16 /
/// BF16 become float32, four times as float64) and a table of names and shapes proportional to the
/// header. Files are read piece by piece (header, then each tensor into its own storage), not whole.
///
/// Paths are byte strings, as the operating system takes them. An empty path, or one holding a NUL
/// byte (which the system would read as the end of the name, so "zz\0.npy" would be "zz"), is refused
/// with mha::Error by every reader and writer.
///
/// Writers never write into what is at the path: they write a new file beside it,
/// "<target>.partial.<pid>.<n>" (created exclusively, never through a link), and rename it over the
/// target once complete, so a failed write leaves the old file as it was and a reader sees either the
/// old file or the whole new one. The target is the path itself, or, when the path is a symbolic link,
/// the file at the end of its chain of links: the link stays and its target gets the new file (a
/// dangling link's target is created). A target that exists and is not a regular file (a directory,
/// FIFO, character or block device, socket) is refused with mha::Error before anything is written.
/// Being replaced rather than rewritten, the new file has a new file's permissions (0666 less the
/// umask), and other hard links to the old file keep the old contents.
///
/// Byte order: both formats are read and written little-endian; the library builds only on
/// little-endian machines (a static_assert says so), which is every machine it targets.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mha/multi_head_attention.hpp"
#include "mha/tensor.hpp"

namespace mha {

// ---- safetensors ---------------------------------------------------------------------------------
/// \name safetensors
///
/// Layout (https://github.com/huggingface/safetensors):
///
///     8 bytes     N, the header length, unsigned little-endian
///     N bytes     UTF-8 JSON object: name -> {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
///                 plus an optional "__metadata__": {string: string}
///     the rest    the data buffer; data_offsets are relative to its start
///
/// Read: dtypes F64, F32, F16, BF16 (floating point) and BOOL. The tensors must tile the buffer exactly:
/// no gaps, no overlaps, no bytes left over, each [b, e) the size its shape and dtype need. The header
/// is at most 100 MB, as in the reference implementation.
/// @{

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  ///< "__metadata__"; empty when the file has none
};

/// Reads a safetensors file. `dtype` is the dtype floating-point tensors are converted to (Float32,
/// Float64 or BFloat16, which rounds to nearest even); std::nullopt keeps F64 as float64 and BF16 as
/// bfloat16, and reads F32 and F16 as float32. BOOL tensors are read as Bool (nonzero bytes = true)
/// whatever `dtype` says.
SafetensorsFile read_safetensors(const std::string& path, std::optional<DType> dtype = std::nullopt);

/// The same from bytes in memory; `name` stands for the file in error messages.
SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, const std::string& name,
                                  std::optional<DType> dtype = std::nullopt);

/// Writes tensors (float32 as F32, float64 as F64, bfloat16 as BF16, bool as BOOL; any strides) and string metadata to
/// `path`, as the file comment says (beside the target, then renamed; links followed; anything but a
/// regular file refused).
/// The header is padded with spaces to a multiple of 8 bytes; tensors are laid out without gaps, wider
/// dtypes first and then by name, so that every tensor starts at a multiple of its element size, as
/// the reference writer does. Names must be valid UTF-8 and not "__metadata__".
void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// The same into memory: the exact bytes write_safetensors would write.
std::vector<std::byte> serialize_safetensors(const std::map<std::string, TensorView>& tensors,
                                             const std::map<std::string, std::string>& metadata = {});
/// @}

// ---- a MultiHeadAttention layer in safetensors -----------------------------------------------------
/// \name A MultiHeadAttention layer in safetensors
/// @{

/// Writes the layer's parameters under PyTorch's state_dict names ("in_proj_weight", "out_proj.bias",
/// ...; see multi_head_attention.hpp) in the layer's dtype, and its config in "__metadata__" as strings:
/// "format": "mha", d_model, num_heads, num_kv_heads, d_k, d_v, kdim, vdim (integers), bias, add_bias_kv,
/// add_zero_attn, batch_first ("true" / "false"), dropout (a decimal that reads back exactly) and dtype
/// ("float32" / "float64" / "bfloat16"; a bfloat16 layer's tensors are stored as BF16). The file loads in PyTorch's
/// nn.MultiheadAttention (via the safetensors package) whenever the config is one PyTorch has (d_k == d_v == d_model /
/// num_heads). Written as write_safetensors writes (beside the target, then renamed; links followed; anything but a
/// regular file refused).
void save_safetensors(const MultiHeadAttention& layer, const std::string& path);

/// The config in `metadata` as save_safetensors writes it: "format" must be "mha", every other key
/// present (num_kv_heads may be absent, in files written before it: num_heads then), integers in
/// decimal, booleans exactly "true" or "false", dropout a decimal number, dtype
/// "float32", "float64" or "bfloat16". Anything else is an mha::Error naming `name` (the file), the key and the
/// value. The values are checked against each other by the layer's constructor, not here.
MultiHeadAttentionConfig config_from_metadata(const std::map<std::string, std::string>& metadata,
                                              const std::string& name);

/// Builds a layer from a safetensors file and loads its parameters strictly (every parameter present,
/// nothing else, shapes exact). Without `config`, the config comes from the "__metadata__" that
/// save_safetensors writes. With `config`, that config is used instead: this is how a file without
/// our metadata (one written from PyTorch's state_dict) is read. The parameters are converted to the
/// config's dtype. Every failure, including a config the layer refuses, is an mha::Error naming the file.
MultiHeadAttention load_multi_head_attention(const std::string& path,
                                             const std::optional<MultiHeadAttentionConfig>& config = std::nullopt);
/// @}

// ---- NumPy .npy ----------------------------------------------------------------------------------
/// \name NumPy .npy
///
/// Layout (numpy/lib/format.py): "\x93NUMPY", major and minor version bytes, the header length
/// (2 bytes little-endian in version 1.0, 4 bytes in 2.0 and 3.0), then the header, a Python dict
/// literal such as {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with spaces and
/// ending in a newline, then the data. Read: versions 1.0, 2.0, 3.0; descr '<f8' (float64), '<f4'
/// (float32), '<f2' (float16, read as float32) and '|b1' (bool). The header is parsed (never
/// evaluated) and must hold exactly those three keys. Fortran-order data is converted to C order, so
/// the tensor has the file's shape and values. Big-endian, structured and object arrays are refused,
/// and the data must be exactly the size the shape needs.
/// @{

Tensor read_npy(const std::string& path);
Tensor parse_npy(std::span<const std::byte> bytes, const std::string& name);

/// Writes a float32, float64 or bool view (any strides) in C order (a bfloat16 one as float32, '<f4',
/// which holds its values exactly: NumPy has no bfloat16), as version 1.0, or 2.0 when the
/// header does not fit version 1.0's 65535 bytes. The header is padded to a multiple of 64 bytes. The
/// file is written as write_safetensors writes (beside the target, then renamed; links followed;
/// anything but a regular file refused).
void write_npy(const std::string& path, const TensorView& tensor);
std::vector<std::byte> serialize_npy(const TensorView& tensor);
/// @}

}  // namespace mha
