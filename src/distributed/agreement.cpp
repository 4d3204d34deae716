// The collective check of a ring call (agreement.hpp).
#include "distributed/agreement.hpp"

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "logit_scalars.hpp"
#include "mha/error.hpp"
#include "splitmix64.hpp"

namespace mha::distributed::detail {
namespace {

std::int64_t dim_or(const TensorView& t, std::int64_t dim) { return t.rank() == 4 ? t.size(dim) : -1; }

[[noreturn]] void fail(const char* what, int rank, const std::string& message) {
  throw Error(std::string(what) + ": rank " + std::to_string(rank) + ": " + message);
}

// How a field reads in a message: enumerators by name ("float32", not 0), doubles in full.
std::string text(std::int64_t x) { return std::to_string(x); }
std::string text(std::uint64_t x) { return std::to_string(x); }
std::string text(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.17g", x);
  return buffer;
}
std::string dtype_text(std::int32_t x) { return dtype_name(static_cast<DType>(x)); }
std::string layout_text(std::int32_t x) { return static_cast<Layout>(x) == Layout::Zigzag ? "zigzag" : "contiguous"; }
std::string kernel_text(std::int32_t x) { return static_cast<Kernel>(x) == Kernel::Reference ? "reference" : "flash"; }
std::string flag_text(std::int32_t x) { return x ? "true" : "false"; }
std::string given_text(std::int32_t x) { return x ? "given" : "not given"; }

// The fields every rank must give alike, compared with rank 0's; the first difference, named.
std::string difference(const RankCall& a, const RankCall& b) {
  auto named = [](const char* name, const std::string& x, const std::string& y) {
    return x == y ? std::string() : std::string(name) + " " + x + ", rank 0 " + y;
  };
  auto differs = [&](const char* name, auto x, auto y) {
    return x == y ? std::string() : named(name, text(x), text(y));
  };
  const std::string checks[] = {
      named("dtype", dtype_text(a.dtype), dtype_text(b.dtype)),
      differs("B", a.B, b.B),
      differs("h", a.h, b.h),
      differs("d_k", a.d_k, b.d_k),
      differs("d_v", a.d_v, b.d_v),
      named("causal", flag_text(a.causal), flag_text(b.causal)),
      named("layout", layout_text(a.layout), layout_text(b.layout)),
      named("kernel", kernel_text(a.kernel), kernel_text(b.kernel)),
      named("key_padding_mask", given_text(a.has_padding), given_text(b.has_padding)),
      std::isnan(a.scale) && std::isnan(b.scale) ? std::string() : differs("scale", a.scale, b.scale),
      differs("dropout_p", a.dropout_p, b.dropout_p),
      differs("dropout_seed", a.dropout_seed, b.dropout_seed),
      differs("key_lengths count", a.key_lengths_count, b.key_lengths_count),
      differs("key_lengths (a digest)", a.key_lengths_digest, b.key_lengths_digest),
      named("sinks", given_text(a.has_sinks), given_text(b.has_sinks)),
      differs("sinks (a digest)", a.sinks_digest, b.sinks_digest),
      differs("window_left", a.window_left, b.window_left),
      differs("window_right", a.window_right, b.window_right),
      named("alibi_slopes", given_text(a.has_alibi), given_text(b.has_alibi)),
      differs("alibi_slopes (a digest)", a.alibi_digest, b.alibi_digest),
      differs("softcap", a.softcap, b.softcap),
      differs("rotary_dim", a.rotary_dim, b.rotary_dim),
      differs("rotary_base", a.rotary_base, b.rotary_base),
      named("rotary_interleaved", flag_text(a.rotary_interleaved), flag_text(b.rotary_interleaved)),
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

// Every rank's query and key rows fit the layout of the whole sequences, or the rank whose do not is
// named, against the lengths the shards fit best (likeliest_length): the sums hold the wrong shard
// itself, and measured by them a right shard can look wrong (10 and 9 rows on two zigzag ranks: L = 19
// gives rank 0 9 rows, rank 1 10).
void check_shard_lengths(const AgreedCall& call, const char* what) {
  const int P = static_cast<int>(call.ranks.size());
  std::vector<std::int64_t> L_rows, S_rows;
  bool L_fits = true, S_fits = true;
  for (int r = 0; r < P; ++r) {
    const RankCall& c = call.ranks[static_cast<std::size_t>(r)];
    L_rows.push_back(c.L_r), S_rows.push_back(c.S_r);
    L_fits = L_fits && c.L_r == rows(call.q_chunks(r));
    S_fits = S_fits && c.S_r == rows(call.kv_chunks(r));
  }
  if (L_fits && S_fits) return;
  // A sequence whose shards all fit is the likeliest length of the other (most calls have L == S).
  const std::int64_t L = L_fits ? call.L : likeliest_length(L_rows, call.layout(), S_fits ? call.S : -1);
  const std::int64_t S = S_fits ? call.S : likeliest_length(S_rows, call.layout(), L_fits ? call.L : -1);
  for (int r = 0; r < P; ++r) {
    const RankCall& c = call.ranks[static_cast<std::size_t>(r)];
    const std::int64_t want_L = rows_of_rank(L, P, r, call.layout()), want_S = rows_of_rank(S, P, r, call.layout());
    if (c.L_r != want_L || c.S_r != want_S)
      fail(what, r,
           "holds " + std::to_string(c.L_r) + " query and " + std::to_string(c.S_r) + " key rows; the " +
               layout_text(c.layout) + " layout over " + std::to_string(P) +
               " ranks that the shards fit best, of L = " + std::to_string(L) + " and S = " + std::to_string(S) +
               ", gives it " + std::to_string(want_L) + " and " + std::to_string(want_S) + " (see shard_chunks)");
  }
}

}  // namespace

std::int64_t rows_of_rank(std::int64_t n, int ranks, int rank, Layout layout) {
  return rows(shard_chunks(n, ranks, rank, layout));
}

std::int64_t likeliest_length(const std::vector<std::int64_t>& rows, Layout layout, std::int64_t hint) {
  const int P = static_cast<int>(rows.size());
  std::int64_t sum = 0;
  std::map<std::int64_t, int> holders;  // a count of rows -> how many ranks hold it
  for (std::int64_t c : rows) sum += c, ++holders[c];
  bool all_fit = true;
  for (int r = 0; r < P && all_fit; ++r) all_fit = rows_of_rank(sum, P, r, layout) == rows[static_cast<std::size_t>(r)];
  if (all_fit) return sum;  // no other length fits them all: each fits its own sum
  // The candidates: the sum, the hint, and around P x each of the commonest counts and rank 0's (a
  // rank's rows are within 2 of n / P in either layout).
  std::vector<std::pair<int, std::int64_t>> common;
  for (const auto& [count, ranks] : holders) common.emplace_back(-ranks, count);
  std::sort(common.begin(), common.end());
  common.resize(std::min<std::size_t>(common.size(), 4));
  common.emplace_back(0, rows.front());
  std::set<std::int64_t> candidates{sum};
  if (hint >= 0) candidates.insert(hint);
  for (const auto& [unused, count] : common)
    for (std::int64_t n = std::max<std::int64_t>(0, (count - 2) * P); n <= (count + 2) * P; ++n) candidates.insert(n);
  std::int64_t best = sum;
  std::tuple<int, bool, bool, int, std::int64_t, std::int64_t> best_score{-1, false, false, 0, 0, 0};
  for (std::int64_t n : candidates) {
    int fits = 0, first_misfit = -1;
    for (int r = 0; r < P; ++r) {
      const bool fit = rows_of_rank(n, P, r, layout) == rows[static_cast<std::size_t>(r)];
      fits += fit;
      if (!fit && first_misfit < 0) first_misfit = r;
    }
    const int odd_one_out = first_misfit < 0 ? 0 : -holders[rows[static_cast<std::size_t>(first_misfit)]];
    const std::tuple score{fits, n == hint, first_misfit != 0, odd_one_out, -std::abs(n - sum), -n};
    if (score > best_score) best_score = score, best = n;
  }
  return best;
}

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
  c.has_sinks = o.sinks.has_value();
  c.sinks_digest = values_digest(o.sinks);
  c.has_alibi = o.alibi_slopes.has_value();
  c.alibi_digest = values_digest(o.alibi_slopes);
  c.window_left = o.window_left, c.window_right = o.window_right;
  c.softcap = o.softcap;
}

std::uint64_t values_digest(const std::optional<TensorView>& values) {
  if (!values || values->rank() != 1 || (values->dtype() != DType::Float32 && values->dtype() != DType::Float64))
    return 0;
  const TensorView& x = *values;
  std::uint64_t digest = mha::detail::mix64(static_cast<std::uint64_t>(x.size(0)));
  for (const double value : mha::detail::per_head_values<double>(values))
    digest = mha::detail::mix64(digest ^ std::bit_cast<std::uint64_t>(value));
  return digest;
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
  check_shard_lengths(call, what);
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
