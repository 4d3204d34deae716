// How a sequence is cut among ranks (mha/distributed.hpp): the chunks each rank holds, and cutting and
// joining tensors along the sequence dimension.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>

#include "distributed/agreement.hpp"
#include "distributed/blocks.hpp"
#include "mha/distributed.hpp"
#include "mha/error.hpp"

namespace mha::distributed {
namespace {

// Chunk c of n rows cut into `count` chunks, the first n % count one row longer.
SequenceChunk chunk(std::int64_t n, std::int64_t count, std::int64_t c) {
  const std::int64_t base = n / count, longer = n % count;
  return {c * base + std::min(c, longer), base + (c < longer ? 1 : 0)};
}

void check_dim(const TensorView& t, std::int64_t dim, const char* what) {
  if (dim < 0 || dim >= t.rank())
    throw Error(std::string(what) + ": dim " + std::to_string(dim) + " is outside a tensor of rank " +
                std::to_string(t.rank()) + " " + shape_str(t.shape()));
}

// The parts (each any strides) joined along dim into one contiguous tensor; they agree elsewhere.
Tensor concatenate(const std::vector<TensorView>& parts, std::int64_t dim) {
  Shape shape = parts.front().shape();
  shape[static_cast<std::size_t>(dim)] = 0;
  for (const TensorView& p : parts) shape[static_cast<std::size_t>(dim)] += p.size(dim);
  Tensor out(parts.front().dtype(), shape);
  std::int64_t outer = 1, inner = static_cast<std::int64_t>(dtype_size(out.dtype()));
  for (std::int64_t d = 0; d < dim; ++d) outer *= shape[static_cast<std::size_t>(d)];
  for (std::int64_t d = dim + 1; d < out.rank(); ++d) inner *= shape[static_cast<std::size_t>(d)];
  const std::int64_t out_row = shape[static_cast<std::size_t>(dim)] * inner;  // bytes per outer index
  auto* dst = static_cast<std::byte*>(out.data());
  std::int64_t written = 0;  // bytes of each outer index filled so far
  for (const TensorView& p : parts) {
    const Tensor dense = Tensor::copy_of(p);
    const std::int64_t part_row = p.size(dim) * inner;
    const auto* src = static_cast<const std::byte*>(dense.data());
    for (std::int64_t o = 0; o < outer && part_row > 0; ++o)
      std::memcpy(dst + o * out_row + written, src + o * part_row, static_cast<std::size_t>(part_row));
    written += part_row;
  }
  return out;
}

}  // namespace

std::vector<SequenceChunk> shard_chunks(std::int64_t n, int ranks, int rank, Layout layout) {
  if (n < 0) throw Error("shard_chunks: expected a sequence length >= 0, got " + std::to_string(n));
  if (ranks < 1 || rank < 0 || rank >= ranks)
    throw Error("shard_chunks: expected 0 <= rank < ranks, got rank " + std::to_string(rank) + " of " +
                std::to_string(ranks));
  if (layout == Layout::Contiguous) return {chunk(n, ranks, rank)};
  return {chunk(n, 2 * ranks, rank), chunk(n, 2 * ranks, 2 * ranks - 1 - rank)};
}

Tensor shard_sequence(const TensorView& full, std::int64_t dim, int ranks, int rank, Layout layout) {
  check_dim(full, dim, "shard_sequence");
  std::vector<TensorView> parts;
  for (SequenceChunk c : shard_chunks(full.size(dim), ranks, rank, layout))
    parts.push_back(detail::rows_along(full, dim, c.start, c.length));
  return concatenate(parts, dim);
}

Tensor unshard_sequence(const std::vector<TensorView>& shards, std::int64_t dim, Layout layout) {
  if (shards.empty()) throw Error("unshard_sequence: expected one shard per rank, got none");
  const int ranks = static_cast<int>(shards.size());
  std::int64_t n = 0;
  for (int r = 0; r < ranks; ++r) {
    const TensorView& s = shards[static_cast<std::size_t>(r)];
    check_dim(s, dim, "unshard_sequence");
    Shape a = s.shape(), b = shards.front().shape();
    a[static_cast<std::size_t>(dim)] = b[static_cast<std::size_t>(dim)] = 0;
    if (a != b || s.dtype() != shards.front().dtype())
      throw Error("unshard_sequence: shard " + std::to_string(r) + " is " + dtype_name(s.dtype()) + " " +
                  shape_str(s.shape()) + ", shard 0 " + dtype_name(shards.front().dtype()) + " " +
                  shape_str(shards.front().shape()) + ": they may differ only in dim " + std::to_string(dim));
    n += s.size(dim);
  }
  // Measured against the length the shards fit best, not their sum (which holds a wrong shard too), so
  // that the message names the shard that is wrong (agreement.hpp).
  std::vector<std::int64_t> rows;
  for (const TensorView& s : shards) rows.push_back(s.size(dim));
  n = detail::likeliest_length(rows, layout);
  // The chunks in sequence order, each a view into the shard that holds it.
  std::vector<std::pair<SequenceChunk, TensorView>> pieces;
  for (int r = 0; r < ranks; ++r) {
    const TensorView& s = shards[static_cast<std::size_t>(r)];
    std::int64_t local = 0;
    const std::vector<SequenceChunk> chunks = shard_chunks(n, ranks, r, layout);
    std::int64_t expected = 0;
    for (SequenceChunk c : chunks) expected += c.length;
    if (expected != s.size(dim))
      throw Error("unshard_sequence: shard " + std::to_string(r) + " has " + std::to_string(s.size(dim)) +
                  " rows in dim " + std::to_string(dim) + "; the layout of the " + std::to_string(n) +
                  " rows that the shards fit best gives it " + std::to_string(expected));
    for (SequenceChunk c : chunks) {
      pieces.emplace_back(c, detail::rows_along(s, dim, local, c.length));
      local += c.length;
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first.start < b.first.start; });
  std::vector<TensorView> parts;
  for (const auto& piece : pieces) parts.push_back(piece.second);
  return concatenate(parts, dim);
}

}  // namespace mha::distributed
