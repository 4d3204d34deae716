// The checks of the layer's inputs (see inputs.hpp).
#include "layer/inputs.hpp"

#include "mha/error.hpp"

namespace mha::detail {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

}  // namespace

void check_input_rank(const TensorView& t, const char* name, bool batch_first, const std::string& positions,
                      const std::string& width) {
  if (t.rank() == 2 || t.rank() == 3) return;
  const std::string layout = batch_first ? "[B, " + positions + ", " + width + "] (batch_first)"
                                         : "[" + positions + ", B, " + width + "] (sequence first)";
  fail(std::string(name) + ": expected rank 3 " + layout + " or rank 2 [" + positions + ", " + width +
       "] (unbatched), got rank " + str(t.rank()) + " " + shape_str(t.shape()));
}

void check_dtype(const TensorView& t, const char* name, DType dtype) {
  if (t.dtype() != dtype)
    fail(std::string(name) + ": expected " + dtype_name(dtype) + " (the layer's dtype), got " + dtype_name(t.dtype()) +
         " " + shape_str(t.shape()));
}

void check_width(const TensorView& t, const char* name, std::int64_t width, const char* width_name) {
  if (t.shape().back() != width)
    fail(std::string(name) + ": expected last dimension " + width_name + " = " + str(width) + ", got shape " +
         shape_str(t.shape()));
}

void check_same_rank(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  if (t.rank() != like.rank())
    fail(std::string(name) + ": expected rank " + str(like.rank()) + " like " + like_name + " " +
         shape_str(like.shape()) + ", got rank " + str(t.rank()) + " " + shape_str(t.shape()));
}

void check_same_batch(const TensorView& t, const char* name, const InputDims& dims, std::int64_t B,
                      const TensorView& like, const char* like_name) {
  if (dims.batched && t.size(dims.batch_dim) != B)
    fail(std::string(name) + ": expected batch size " + str(B) + " like " + like_name + " " + shape_str(like.shape()) +
         ", got shape " + shape_str(t.shape()));
}

TensorView contiguous_view(const TensorView& x, Tensor& storage) {
  if (x.is_contiguous()) return x;
  storage = Tensor::copy_of(x);
  return storage.view();
}

}  // namespace mha::detail
