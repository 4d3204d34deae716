// Ring attention (mha/distributed.hpp): the forward and the backward, side by side.
//
// Step s = 0 .. P-1 of rank r works on the key/value block of rank src = r - s (mod P): it posts the
// transfer of that block to r + 1 and the receipt of the next one from r - 1, runs the kernel on every
// pair of its query chunks and the block's key chunks that the mask leaves work in, then waits. The
// forward merges each pair's (out, lse) into its running result; the backward adds each pair's dQ
// locally and its dK, dV into an accumulator that follows the block around the ring (one hop behind
// it) and reaches the block's owner after the last step. Every sum runs in a fixed order, so the
// results are the same on every run for a given P and thread count.
//
// Legend: as in mha/distributed.hpp.
#include <algorithm>
#include <climits>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/attention_core.hpp"
#include "attention/sinks.hpp"
#include "distributed/agreement.hpp"
#include "distributed/blocks.hpp"
#include "dtype_dispatch.hpp"
#include "logit_scalars.hpp"
#include "mha/error.hpp"

namespace mha::distributed {
namespace {

using detail::AgreedCall;
using detail::BlockLayout;

enum Tag : int { kBlockTag = 1, kGradientTag = 2 };

template <class T>
MPI_Datatype mpi_type() {
  return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

// A private duplicate of the caller's communicator, so our messages never meet theirs.
struct Ring {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  explicit Ring(MPI_Comm parent) {
    MPI_Comm_dup(parent, &comm);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
  }
  ~Ring() { MPI_Comm_free(&comm); }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  int next() const { return (rank + 1) % size; }
  int previous() const { return (rank + size - 1) % size; }
  int block_owner(int step) const { return (rank - step % size + size) % size; }
};

// The single-process options this rank's arguments are checked with: the score as given (scale,
// window, ALiBi slopes, softcap, sinks, this rank's key padding), checked as one call checks it; key
// lengths are checked against the whole sequence by the agreement instead.
AttentionOptions local_options(const RingOptions& o) {
  AttentionOptions a;
  static_cast<ScoreSpec&>(a) = o;
  a.key_lengths.clear();
  a.attn_mask.reset();  // refused by check_local first
  a.dropout_p = o.dropout_p;
  a.dropout_seed = o.dropout_seed;
  a.kernel = o.kernel;
  return a;
}

// The dtypes the ring runs in (bfloat16 across ranks is not built yet).
bool ring_dtype(DType dtype) { return dtype == DType::Float32 || dtype == DType::Float64; }

void check_local(const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& o) {
  if (o.attn_mask)
    throw Error("attn_mask: not taken across ranks (a per-position mask would need L_r x S memory per rank); "
                "use causal, a window, key_padding_mask or key_lengths");
  mha::detail::validate_attention(q, k, v, local_options(o));
  if (!ring_dtype(q.dtype()))
    throw Error(std::string("q: ring attention takes float32 or float64, got ") + dtype_name(q.dtype()) +
                " (bfloat16 across ranks is not built yet)");
  if (k.size(1) != q.size(1))
    throw Error("k: ring attention takes as many key/value heads as query heads (" + std::to_string(q.size(1)) +
                "), got " + std::to_string(k.size(1)) + " (grouped-query attention across ranks is not built yet)");
  if (o.key_padding_mask && o.key_padding_mask->dtype() != DType::Bool)
    throw Error("key_padding_mask: ring attention takes a bool mask [B, S_r], got " +
                std::string(dtype_name(o.key_padding_mask->dtype())));
  const std::int64_t elements = (k.numel() + v.numel()) * 2;  // what one message holds, at most (backward)
  if (elements > INT_MAX)
    throw Error("k, v: a block of " + std::to_string(elements) + " elements exceeds one MPI message (" +
                std::to_string(INT_MAX) + "); use more ranks");
}

// Where query chunk qc sits relative to key chunk kc (the kernels' query_shift): its first query's
// position in the whole sequence, qc.start + S - L (bottom-right aligned, as one call places it), minus
// kc's first key's.
std::int64_t query_shift(const AgreedCall& call, SequenceChunk qc, SequenceChunk kc) {
  return qc.start + (call.S - call.L) - kc.start;
}

// Whether some query of qc may see some key of kc by causal and the window (positions as query_shift):
// the pairs with none are skipped.
bool pair_has_work(const RingOptions& o, std::int64_t shift, SequenceChunk qc, SequenceChunk kc) {
  const std::int64_t first = shift, last = shift + qc.length - 1;  // the queries' positions, from kc's first key
  std::int64_t right = o.window_right;                             // how far right of its position a query sees
  if (o.causal) right = right >= 0 ? std::min<std::int64_t>(right, 0) : 0;
  if (right >= 0 && last + right < 0) return false;                               // every key after every reach
  if (o.window_left >= 0 && first - o.window_left > kc.length - 1) return false;  // every key before it
  return true;
}

// The options of the kernel call for query chunk qc and key chunk kc of the block of rank src: the score
// as given (run with query_shift(qc, kc), so causal, the window and ALiBi take whole-sequence positions),
// the key padding and lengths of kc's keys, dropout at the chunks' offsets; the sinks are left to the
// merge (finish_merged_rows).
template <class T>
AttentionOptions pair_options(const RingOptions& o, SequenceChunk qc, SequenceChunk kc, const BlockLayout<T>& layout,
                              const T* block, std::int64_t S_src, std::int64_t kc_local) {
  AttentionOptions a;
  static_cast<ScoreSpec&>(a) = o;
  a.key_padding_mask.reset(), a.key_lengths.clear(), a.sinks.reset();
  if (layout.padding) a.key_padding_mask = layout.mask(block, S_src, kc_local, kc.length);
  for (std::int64_t n : o.key_lengths) a.key_lengths.push_back(std::clamp<std::int64_t>(n - kc.start, 0, kc.length));
  a.dropout_p = o.dropout_p;
  a.dropout_seed = o.dropout_seed;
  a.dropout_query_offset = qc.start;
  a.dropout_key_offset = kc.start;
  a.need_lse = true;
  a.kernel = o.kernel;
  return a;
}

// Calls work(qc, q_local_start, kc, k_local_start, shift) for every pair of this rank's query chunks and
// the key chunks of rank src that has work (pair_has_work: with causal those at or before the query
// chunk; with a window those within its reach), shift = query_shift(qc, kc).
template <class Work>
void for_each_pair(const AgreedCall& call, int rank, int src, const RingOptions& o, Work&& work) {
  std::int64_t q_local = 0;
  for (SequenceChunk qc : call.q_chunks(rank)) {
    std::int64_t k_local = 0;
    for (SequenceChunk kc : call.kv_chunks(src)) {
      const std::int64_t shift = query_shift(call, qc, kc);
      if (qc.length > 0 && kc.length > 0 && pair_has_work(o, shift, qc, kc)) work(qc, q_local, kc, k_local, shift);
      k_local += kc.length;
    }
    q_local += qc.length;
  }
}

struct Requests {
  std::vector<MPI_Request> pending;
  void wait() {
    MPI_Waitall(static_cast<int>(pending.size()), pending.data(), MPI_STATUSES_IGNORE);
    pending.clear();
  }
};

// Posts, at step `step`, the sending of the block in `current` to the next rank and the receipt of the
// next step's block into `next` from the previous one (none at the last step): they run while the
// kernel works on `current`.
template <class T>
Requests pass_block_on(const Ring& ring, const AgreedCall& call, const BlockLayout<T>& layout, int step,
                       std::vector<T>& current, std::vector<T>& next) {
  Requests transfer;
  if (step + 1 == ring.size) return transfer;
  auto elements = [&](int owner) { return static_cast<int>(layout.elements(call.S_of(owner))); };
  transfer.pending.resize(2);
  MPI_Irecv(next.data(), elements(ring.block_owner(step + 1)), mpi_type<T>(), ring.previous(), kBlockTag, ring.comm,
            &transfer.pending[0]);
  MPI_Isend(current.data(), elements(ring.block_owner(step)), mpi_type<T>(), ring.next(), kBlockTag, ring.comm,
            &transfer.pending[1]);
  return transfer;
}

template <class T>
RingResult forward(const TensorView& q, const TensorView& k, const TensorView& v, MPI_Comm comm, const RingOptions& o) {
  Ring ring(comm);
  const auto mine = detail::describe_call(q, k, v, o, [&] { check_local(q, k, v, o); });
  const AgreedCall call = detail::agree(ring.comm, mine, o, "ring_attention");
  const std::int64_t B = mine.B, h = mine.h, L_r = mine.L_r;
  const BlockLayout<T> layout{B, h, mine.d_k, mine.d_v, o.key_padding_mask.has_value()};

  std::vector<T> current(static_cast<std::size_t>(layout.elements(call.S_max()))), next(current.size());
  layout.pack(current.data(), k, v, o.key_padding_mask ? &*o.key_padding_mask : nullptr);
  RingResult result{Tensor(dtype_of<T>(), {B, h, L_r, mine.d_v}), Tensor(dtype_of<T>(), {B, h, L_r})};
  std::fill_n(result.lse.data_as<T>(), result.lse.numel(), -std::numeric_limits<T>::infinity());
  std::vector<std::uint8_t> all_minus_inf(static_cast<std::size_t>(result.lse.numel()));  // see merge_partial

  for (int step = 0; step < ring.size; ++step) {
    const int src = ring.block_owner(step);
    Requests transfer = pass_block_on(ring, call, layout, step, current, next);
    for_each_pair(
        call, ring.rank, src, o,
        [&](SequenceChunk qc, std::int64_t q_local, SequenceChunk kc, std::int64_t k_local, std::int64_t shift) {
          const T* block = current.data();
          // The kernel behind scaled_dot_product_attention (the arguments were checked once, above),
          // told its keys are a part (a row whose allowed logits here are all -inf is no weight yet)
          // and where its queries sit relative to its keys.
          AttentionResult part;
          part.out = Tensor::uninitialized(dtype_of<T>(), {B, h, qc.length, mine.d_v});
          mha::detail::run_attention(
              detail::rows_of(q, q_local, qc.length), layout.k(block, call.S_of(src), k_local, kc.length),
              layout.v(block, call.S_of(src), k_local, kc.length),
              pair_options(o, qc, kc, layout, block, call.S_of(src), k_local), {part.out.data(), part.out.strides()},
              part.weights, part.lse, /*partial_over_keys=*/true, shift);
          detail::merge_partial<T>(result.out, result.lse, q_local, part.out, part.lse, all_minus_inf);
        });
    transfer.wait();
    std::swap(current, next);
  }
  detail::finish_merged_rows<T>(result.out, result.lse, all_minus_inf, mha::detail::per_head_values<T>(o.sinks));
  return result;
}

// dsinks [h] in the sinks' dtype, the same on every rank: each rank's rows summed in float64
// (sinks.hpp), the ranks' sums gathered and added in rank order.
Tensor sink_gradients_over_ranks(const Ring& ring, const TensorView& dout, const TensorView& out, const TensorView& lse,
                                 const TensorView& sinks) {
  const std::size_t h = static_cast<std::size_t>(sinks.size(0));
  std::vector<double> mine(h, 0.0), all(h * static_cast<std::size_t>(ring.size));
  mha::detail::accumulate_sink_gradient(dout, out, lse, sinks, mine);
  MPI_Allgather(mine.data(), static_cast<int>(h), MPI_DOUBLE, all.data(), static_cast<int>(h), MPI_DOUBLE, ring.comm);
  std::vector<double> sum(h, 0.0);
  for (int r = 0; r < ring.size; ++r)
    for (std::size_t head = 0; head < h; ++head) sum[head] += all[static_cast<std::size_t>(r) * h + head];
  return mha::detail::sink_gradient_tensor(sum, sinks.dtype());
}

// One chunk pair's gradients: the backward kernel (on arguments the caller checked) with the forward's
// query shift, into zeroed buffers (it requires them zero). dout, q, out, lse: the query chunk's rows
// ([B, h, n, *]); k, v: the key chunk's ([B, h, m, *]). Returns dq [B, h, n, d_k], dk [B, h, m, d_k],
// dv [B, h, m, d_v].
AttentionGradients pair_gradients(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse, const AttentionOptions& options,
                                  std::int64_t shift) {
  AttentionGradients g{Tensor(q.dtype(), q.shape()), Tensor(q.dtype(), k.shape()), Tensor(q.dtype(), v.shape())};
  mha::detail::run_attention_backward(dout, q, k, v, out, lse, options, {g.dq.data(), g.dq.strides()},
                                      {g.dk.data(), g.dk.strides()}, {g.dv.data(), g.dv.strides()}, shift);
  return g;
}

template <class T>
AttentionGradients backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& lse, MPI_Comm comm, const RingOptions& o) {
  Ring ring(comm);
  const auto mine = detail::describe_call(q, k, v, o, [&] {
    check_local(q, k, v, o);
    // out and lse are this rank's rows of the whole result: as the single-process backward checks them
    mha::detail::validate_attention_backward(dout, q, k, v, out, lse, local_options(o));
  });
  const AgreedCall call = detail::agree(ring.comm, mine, o, "ring_attention_backward");
  const std::int64_t B = mine.B, h = mine.h, L_r = mine.L_r, d_k = mine.d_k, d_v = mine.d_v;
  const BlockLayout<T> layout{B, h, d_k, d_v, o.key_padding_mask.has_value()};
  auto gradient_elements = [&](int rank) {
    return layout.k_elements(call.S_of(rank)) + layout.v_elements(call.S_of(rank));
  };

  std::vector<T> current(static_cast<std::size_t>(layout.elements(call.S_max()))), next(current.size());
  layout.pack(current.data(), k, v, o.key_padding_mask ? &*o.key_padding_mask : nullptr);
  Tensor dq(dtype_of<T>(), {B, h, L_r, d_k});  // zero
  // dK, dV of the block being worked on: [B, h, S_src, d_k] then [B, h, S_src, d_v]
  std::vector<T> gradients, gradients_in(static_cast<std::size_t>(gradient_elements(ring.rank)));
  std::vector<T> gradients_out;  // what is on its way to the next rank
  Requests gradient_sent;

  for (int step = 0; step < ring.size; ++step) {
    const int src = ring.block_owner(step);
    const std::int64_t S_src = call.S_of(src);
    Requests transfer = pass_block_on(ring, call, layout, step, current, next);
    Requests gradient_received;  // the sum of the ranks before this one, for the same block
    if (step > 0) {
      gradients_in.assign(static_cast<std::size_t>(gradient_elements(src)), T(0));
      gradient_received.pending.resize(1);
      MPI_Irecv(gradients_in.data(), static_cast<int>(gradients_in.size()), mpi_type<T>(), ring.previous(),
                kGradientTag, ring.comm, &gradient_received.pending[0]);
    }
    gradients.assign(static_cast<std::size_t>(gradient_elements(src)), T(0));
    for_each_pair(
        call, ring.rank, src, o,
        [&](SequenceChunk qc, std::int64_t q_local, SequenceChunk kc, std::int64_t k_local, std::int64_t shift) {
          const T* block = current.data();
          auto rows = [&](const TensorView& t) { return detail::rows_of(t, q_local, qc.length); };
          const AttentionGradients part =
              pair_gradients(rows(dout), rows(q), layout.k(block, S_src, k_local, kc.length),
                             layout.v(block, S_src, k_local, kc.length), rows(out), rows(lse),
                             pair_options(o, qc, kc, layout, block, S_src, k_local), shift);
          detail::add_rows<T>(dq.data_as<T>(), L_r, q_local, part.dq);
          detail::add_rows<T>(gradients.data(), S_src, k_local, part.dk);
          detail::add_rows<T>(gradients.data() + layout.k_elements(S_src), S_src, k_local, part.dv);
        });
    if (step > 0) {  // earlier ranks' sum first, then this rank's part: one order on every run
      gradient_received.wait();
      for (std::size_t i = 0; i < gradients.size(); ++i) gradients[i] = gradients_in[i] + gradients[i];
    }
    gradient_sent.wait();
    if (ring.size > 1) {
      gradients_out = std::move(gradients);
      gradient_sent.pending.resize(1);
      MPI_Isend(gradients_out.data(), static_cast<int>(gradients_out.size()), mpi_type<T>(), ring.next(), kGradientTag,
                ring.comm, &gradient_sent.pending[0]);
    }
    transfer.wait();
    std::swap(current, next);
  }
  if (ring.size > 1) {  // this rank's own block comes home from the last rank that used it
    gradients.assign(static_cast<std::size_t>(gradient_elements(ring.rank)), T(0));
    MPI_Recv(gradients.data(), static_cast<int>(gradients.size()), mpi_type<T>(), ring.previous(), kGradientTag,
             ring.comm, MPI_STATUS_IGNORE);
    gradient_sent.wait();
  }
  const std::int64_t S_r = mine.S_r;
  AttentionGradients g{std::move(dq), Tensor(dtype_of<T>(), {B, h, S_r, d_k}), Tensor(dtype_of<T>(), {B, h, S_r, d_v})};
  std::copy_n(gradients.data(), g.dk.numel(), g.dk.data_as<T>());
  std::copy_n(gradients.data() + g.dk.numel(), g.dv.numel(), g.dv.data_as<T>());
  if (o.sinks) g.dsinks = sink_gradients_over_ranks(ring, dout, out, lse, *o.sinks);
  return g;
}

}  // namespace

RingResult ring_attention(const TensorView& q, const TensorView& k, const TensorView& v, MPI_Comm comm,
                          const RingOptions& options) {
  // A dtype the ring does not take runs as float32 so as to reach the agreement, which reports it.
  return mha::detail::dispatch_float32_or_float64(ring_dtype(q.dtype()) ? q.dtype() : DType::Float32,
                                                  [&](auto t) { return forward<decltype(t)>(q, k, v, comm, options); });
}

AttentionGradients ring_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                           const TensorView& v, const TensorView& out, const TensorView& lse,
                                           MPI_Comm comm, const RingOptions& options) {
  return mha::detail::dispatch_float32_or_float64(ring_dtype(q.dtype()) ? q.dtype() : DType::Float32, [&](auto t) {
    return backward<decltype(t)>(dout, q, k, v, out, lse, comm, options);
  });
}

}  // namespace mha::distributed
