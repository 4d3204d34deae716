// The collective check of a ring call (agreement.hpp).
#include "distributed/agreement.hpp"

#include <cmath>
#include <limits>

#include "mha/error.hpp"
#include "splitmix64.hpp"

namespace mha::distributed::detail {
namespace {

std::int64_t dim_or(const TensorView& t, std::int64_t dim) { return t.rank() == 4 ? t.size(dim) : -1; }

[[noreturn]] void fail(const char* what, int rank, const std::string& message) {
  throw Error(std::string(what) + ": rank " + std::to_string(rank) + ": " + message);
}

// The fields every rank must give alike, compared with rank 0's; the first difference, named.
std::string difference(const RankCall& a, const RankCall& b) {
  auto differs = [](const char* name, auto x, auto y) {
    return x == y ? std::string() : std::string(name) + " " + std::to_string(x) + ", rank 0 " + std::to_string(y);
  };
  const std::string checks[] = {
      differs("dtype", a.dtype, b.dtype),  // as the DType enumerator
      differs("B", a.B, b.B),
      differs("h", a.h, b.h),
      differs("d_k", a.d_k, b.d_k),
      differs("d_v", a.d_v, b.d_v),
      differs("causal", a.causal, b.causal),
      differs("layout", a.layout, b.layout),
      differs("kernel", a.kernel, b.kernel),
      differs("key_padding_mask given", a.has_padding, b.has_padding),
      std::isnan(a.scale) && std::isnan(b.scale) ? std::string() : differs("scale", a.scale, b.scale),
      differs("dropout_p", a.dropout_p, b.dropout_p),
      differs("dropout_seed", a.dropout_seed, b.dropout_seed),
      differs("key_lengths count", a.key_lengths_count, b.key_lengths_count),
      differs("key_lengths (a digest)", a.key_lengths_digest, b.key_lengths_digest),
  };
  for (const std::string& c : checks)
    if (!c.empty()) return c;
  return {};
}

std::int64_t rows(const std::vector<SequenceChunk>& chunks) {
  std::int64_t n = 0;
  for (SequenceChunk c : chunks) n += c.length;
  return n;
}

}  // namespace

void fill_call(RankCall& c, const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& o) {
  c.dtype = static_cast<std::int32_t>(q.dtype());
  c.causal = o.causal;
  c.layout = static_cast<std::int32_t>(o.layout);
  c.kernel = static_cast<std::int32_t>(o.kernel);
  c.has_padding = o.key_padding_mask.has_value();
  c.B = dim_or(q, 0);
  c.h = dim_or(q, 1);
  c.L_r = dim_or(q, 2);
  c.S_r = dim_or(k, 2);
  c.d_k = dim_or(q, 3);
  c.d_v = dim_or(v, 3);
  c.scale = o.scale ? *o.scale : std::numeric_limits<double>::quiet_NaN();
  c.dropout_p = o.dropout_p;
  c.dropout_seed = o.dropout_seed;
  c.key_lengths_count = static_cast<std::int64_t>(o.key_lengths.size());
  c.key_lengths_digest = key_lengths_digest(o.key_lengths);
}

std::uint64_t key_lengths_digest(const std::vector<std::int64_t>& lengths) {
  std::uint64_t digest = mha::detail::mix64(lengths.size());
  for (std::int64_t n : lengths) digest = mha::detail::mix64(digest ^ static_cast<std::uint64_t>(n));
  return digest;
}

std::vector<SequenceChunk> AgreedCall::q_chunks(int rank) const {
  return shard_chunks(L, static_cast<int>(ranks.size()), rank, layout());
}
std::vector<SequenceChunk> AgreedCall::kv_chunks(int rank) const {
  return shard_chunks(S, static_cast<int>(ranks.size()), rank, layout());
}

AgreedCall agree(MPI_Comm comm, const RankCall& mine, const RingOptions& options, const char* what) {
  int P = 0;
  MPI_Comm_size(comm, &P);
  AgreedCall call;
  call.ranks.resize(static_cast<std::size_t>(P));
  MPI_Allgather(&mine, sizeof(RankCall), MPI_BYTE, call.ranks.data(), sizeof(RankCall), MPI_BYTE, comm);

  // Every rank runs the same checks on the same data, in the same order: the same error everywhere.
  for (int r = 0; r < P; ++r)
    if (call.ranks[static_cast<std::size_t>(r)].error[0] != '\0')
      fail(what, r, call.ranks[static_cast<std::size_t>(r)].error);
  for (int r = 1; r < P; ++r) {
    const std::string d = difference(call.ranks[static_cast<std::size_t>(r)], call.ranks.front());
    if (!d.empty()) fail(what, r, "differs from rank 0 in " + d);
  }
  for (const RankCall& c : call.ranks) call.L += c.L_r, call.S += c.S_r;
  for (int r = 0; r < P; ++r) {
    const RankCall& c = call.ranks[static_cast<std::size_t>(r)];
    const std::int64_t want_L = rows(call.q_chunks(r)), want_S = rows(call.kv_chunks(r));
    if (c.L_r != want_L || c.S_r != want_S)
      fail(what, r,
           "holds " + std::to_string(c.L_r) + " query and " + std::to_string(c.S_r) + " key rows; the " +
               (options.layout == Layout::Zigzag ? "zigzag" : "contiguous") + " layout of L = " +
               std::to_string(call.L) + ", S = " + std::to_string(call.S) + " over " + std::to_string(P) +
               " ranks gives it " + std::to_string(want_L) + " and " + std::to_string(want_S) + " (see shard_chunks)");
  }
  if (options.causal && call.L != call.S)
    fail(what, 0,
         "causal needs as many queries as keys over the whole sequence, got L = " + std::to_string(call.L) +
             ", S = " + std::to_string(call.S));
  const RankCall& c0 = call.ranks.front();
  if (!options.key_lengths.empty() && c0.key_lengths_count != c0.B)
    fail(what, 0,
         "key_lengths: expected B = " + std::to_string(c0.B) + " lengths, got " + std::to_string(c0.key_lengths_count));
  for (std::int64_t n : options.key_lengths)
    if (n < 0 || n > call.S)
      fail(what, 0,
           "key_lengths: expected lengths in [0, S = " + std::to_string(call.S) + "], got " + std::to_string(n));
  return call;
}

void agree_on_errors(MPI_Comm comm, const std::string& error, const char* what) {
  RankCall mine;  // only its error field is read
  std::copy_n(error.begin(), std::min(error.size(), sizeof mine.error - 1), mine.error);
  int P = 0;
  MPI_Comm_size(comm, &P);
  std::vector<RankCall> all(static_cast<std::size_t>(P));
  MPI_Allgather(&mine, sizeof(RankCall), MPI_BYTE, all.data(), sizeof(RankCall), MPI_BYTE, comm);
  for (int r = 0; r < P; ++r)
    if (all[static_cast<std::size_t>(r)].error[0] != '\0') fail(what, r, all[static_cast<std::size_t>(r)].error);
}

}  // namespace mha::distributed::detail
