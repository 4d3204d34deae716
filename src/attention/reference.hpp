// The reference attention kernel: the specification every faster kernel is tested against.
#pragma once

#include "attention/params.hpp"

namespace mha::detail {

template <class T>
void reference_attention_forward(const AttentionParams<T>& p);

// Accumulates into dq, dk, dv, which must be zero on entry.
template <class T>
void reference_attention_backward(const AttentionBackwardParams<T>& p);

}  // namespace mha::detail
