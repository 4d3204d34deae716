// The one small collective before any exchange of a ring call (mha/distributed.hpp, "Errors"): every
// rank states its sizes, options and local error; every rank checks them all the same way, so a bad
// or inconsistent argument anywhere makes every rank throw the same mha::Error, and no rank waits for
// a message that will never come.
//
// Legend: as in mha/distributed.hpp.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "mha/distributed.hpp"

namespace mha::distributed::detail {

// What one rank brings to a call. Plain data, sent as bytes (the ranks run the same build).
struct RankCall {
  std::int32_t dtype = 0, causal = 0, layout = 0, kernel = 0, has_padding = 0;
  std::int64_t B = 0, h = 0, L_r = 0, S_r = 0, d_k = 0, d_v = 0;
  double scale = 0, dropout_p = 0;  // scale: NaN when the default
  std::uint64_t dropout_seed = 0, key_lengths_digest = 0;
  std::int32_t has_sinks = 0, has_alibi = 0;
  std::uint64_t sinks_digest = 0, alibi_digest = 0;  // of the sinks' and the ALiBi slopes' values (values_digest)
  std::int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  std::int64_t key_lengths_count = 0;
  std::int64_t rotary_dim = 0;  // the ring layer's rotary embedding (0: none; ring_attention's calls leave it so)
  double rotary_base = 0;
  std::int32_t rotary_interleaved = 0;
  char error[256] = {};  // this rank's own argument error, or empty
};

// The call as every rank agreed on it.
struct AgreedCall {
  std::vector<RankCall> ranks;  // [P]
  std::int64_t L = 0, S = 0;    // the whole sequence
  std::vector<SequenceChunk> q_chunks(int rank) const;
  std::vector<SequenceChunk> kv_chunks(int rank) const;
  Layout layout() const { return static_cast<Layout>(ranks.front().layout); }
  std::int64_t S_of(int rank) const { return ranks[static_cast<std::size_t>(rank)].S_r; }  // a rank's key rows
  std::int64_t S_max() const {  // the most key rows any rank holds: the size of a block buffer
    std::int64_t most = 0;
    for (const RankCall& c : ranks) most = std::max(most, c.S_r);
    return most;
  }
};

// A 64-bit digest of the key lengths, by which the ranks compare them.
std::uint64_t key_lengths_digest(const std::vector<std::int64_t>& lengths);

// A 64-bit digest of a float32 or float64 vector's values as float64 bits (the sinks, the ALiBi slopes),
// by which the ranks compare them; 0 for none or another shape or dtype (which the local checks refuse).
std::uint64_t values_digest(const std::optional<TensorView>& values);

// The whole length that shards of rows[r] rows (rank r's) most likely came from, by which a wrong
// shard is told from the right ones (the sum of the rows, which a wrong shard is part of, blames
// another rank): the length whose layout the most ranks fit; on a tie, `hint` (where >= 0), then one
// that rank 0 fits (rank 0 is the reference, as for the options), then the one under which the first
// rank that does not fit is the odd one out (the fewest ranks hold its count), then the nearest to the
// sum. The sum itself when every rank fits it. (Two ranks cannot tell a short shard on one from a
// long one on the other: rank 0 is then taken to be right.)
std::int64_t likeliest_length(const std::vector<std::int64_t>& rows, Layout layout, std::int64_t hint = -1);

// The rows of shard_chunks(n, ranks, rank, layout).
std::int64_t rows_of_rank(std::int64_t n, int ranks, int rank, Layout layout);

// The sizes and options part of describe_call; sizes of a tensor that is not 4-D are -1.
void fill_call(RankCall& c, const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& o);

// This rank's RankCall for q [B, h, L_r, d_k], k, v and the options; `check` runs the local argument
// checks (those of the single-process call), its mha::Error becoming the error field.
template <class Check>
RankCall describe_call(const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& o,
                       Check&& check) {
  RankCall c;
  try {
    check();
  } catch (const std::exception& e) {
    std::string message = e.what();
    message.resize(std::min<std::size_t>(message.size(), sizeof c.error - 1));
    std::copy(message.begin(), message.end(), c.error);
  }
  fill_call(c, q, k, v, o);
  return c;
}

// Allgathers every rank's call and checks them (see the file comment); throws mha::Error, the same on
// every rank, naming `what` (the function) and the rank at fault.
AgreedCall agree(MPI_Comm comm, const RankCall& mine, const RingOptions& options, const char* what);

// The errors part of agree() alone: every rank states its error (or none); if any rank has one,
// every rank throws the same mha::Error naming `what` and the first such rank.
void agree_on_errors(MPI_Comm comm, const std::string& error, const char* what);

}  // namespace mha::distributed::detail
