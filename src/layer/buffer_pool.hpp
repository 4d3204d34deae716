// The buffers a layer reuses from one forward / backward to the next: the projections, the
// concatenated heads and the backward's intermediate gradients. A fresh allocation of that size comes
// from the operating system as new pages, each faulted in (and once zeroed by Tensor): measured here
// (perf, B=8 N=64 E=256, one thread) at about half of a training step before this pool existed.
//
// take() hands out a held tensor of the same dtype and element count (its contents are stale: the
// caller overwrites it whole) or allocates a new, uninitialised one; give() takes a tensor back. A held tensor
// that no call took for a whole cycle (one forward and the backward after it) is freed at the next
// forward, so changing shapes do not make the pool grow: it holds at most the buffers of the last two
// calls.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "mha/tensor.hpp"

namespace mha::detail {

class BufferPool {
 public:
  // A tensor of `shape` and `dtype`, its contents unspecified (stale from the pool, or new): for buffers
  // the caller overwrites whole.
  Tensor take(DType dtype, Shape shape) {
    const std::int64_t numel = shape_numel(shape);
    for (std::size_t i = 0; i < held_.size(); ++i) {
      if (held_[i].tensor.dtype() != dtype || held_[i].tensor.numel() != numel) continue;
      Tensor t = std::move(held_[i].tensor);
      held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
      return std::move(t).reshaped(std::move(shape));
    }
    return Tensor::uninitialized(dtype, std::move(shape));
  }

  // Holds `t` for a later take(); a tensor under kMinBytes (or undefined) is dropped.
  void give(Tensor&& t) {
    if (t.defined() && t.nbytes() >= kMinBytes) held_.push_back({std::move(t), cycle_});
  }

  // Smaller blocks come back from malloc's free lists, already mapped; held here they only changed
  // where oneDNN's per-call scratch lands in the heap (measured: +20% at B=1, N=16, E=64).
  static constexpr std::size_t kMinBytes = 64 * 1024;

  // Starts a cycle (at each forward): frees what no call took since the start of the previous one.
  void start_cycle() {
    ++cycle_;
    std::erase_if(held_, [&](const Held& h) { return h.cycle + 1 < cycle_; });
  }

 private:
  struct Held {
    Tensor tensor;
    std::uint64_t cycle;  // when it was given back
  };
  std::vector<Held> held_;
  std::uint64_t cycle_ = 0;
};

}  // namespace mha::detail
