// varlen_attention and its backward (mha/varlen.hpp): a packed batch of variable-length sequences.
//   (a) each sequence's rows of out, lse, dq, dk and dv are bit for bit those of scaled_dot_product_attention
//       (and its backward) run on that sequence alone, as a contiguous [1, h, L_i, d] batch with the same
//       options (dropout offsets at the sequence's packed positions): same kernel, same per-sequence
//       shapes; on hand-picked packs with empty sequences (L_i = 0, S_i = 0), one-token sequences,
//       L_i != S_i, sequences over several of the fused kernel's query and key blocks, grouped heads,
//       causal, window, ALiBi, softcap, sinks and dropout, for both kernels and every dtype;
//   (b) bad offsets and the options a packed batch cannot take are refused naming the argument.
//
// Legend: n sequences, h query heads, h_kv key/value heads, total_q / total_k packed rows, L_i / S_i the
// queries / keys of sequence i, d_k, d_v head widths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "support/bad_input.hpp"
#include "support/bitwise.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;
using mha::Kernel;

struct VarlenCase {
  const char* name;
  std::int64_t h, h_kv, d_k, d_v;
  std::vector<std::int64_t> L, S;  // per sequence
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  bool alibi = false, sinks = false;
  double softcap = 0.0, dropout_p = 0.0;
};

void PrintTo(const VarlenCase& c, std::ostream* os) { *os << c.name; }

std::vector<VarlenCase> varlen_cases() {
  return {
      {"mha_mixed_lengths", 4, 4, 16, 16, {5, 1, 0, 37, 70}, {5, 1, 3, 37, 65}},
      {"gqa_causal_empty_sequences", 6, 2, 8, 5, {9, 70, 1, 0, 3, 0}, {30, 70, 0, 4, 0, 0}, true},
      {"mqa_window_alibi_softcap", 4, 1, 12, 12, {17, 3, 80}, {17, 40, 80}, true, 8, 2, true, false, 5.0},
      {"dropout_sinks_causal", 2, 2, 8, 8, {6, 0, 40, 1}, {10, 7, 33, 1}, true, -1, -1, false, true, 0.0, 0.3},
      {"one_sequence", 3, 3, 5, 7, {50}, {20}},
      {"several_kernel_blocks_causal", 2, 1, 16, 16, {3, 300, 130}, {600, 300, 257}, true},
      {"no_sequences", 2, 1, 4, 4, {}, {}},
  };
}

std::vector<std::int64_t> prefix_sums(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> cu(lengths.size() + 1, 0);
  std::partial_sum(lengths.begin(), lengths.end(), cu.begin() + 1);
  return cu;
}

// Rows [begin, end) of a packed [total, heads, d] tensor as a contiguous [1, heads, end - begin, d] one.
Tensor sequence_copy(const Tensor& packed, std::int64_t begin, std::int64_t end) {
  const std::int64_t heads = packed.size(1), d = packed.size(2), T = end - begin;
  const std::vector<double> x = to_doubles(packed);
  std::vector<double> y(static_cast<std::size_t>(heads * T * d));
  for (std::int64_t head = 0; head < heads; ++head)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t c = 0; c < d; ++c)
        y[static_cast<std::size_t>((head * T + t) * d + c)] =
            x[static_cast<std::size_t>(((begin + t) * heads + head) * d + c)];
  return make_tensor(packed.dtype(), {1, heads, T, d}, y);
}

// Columns [begin, end) of a packed lse [h, total_q], as [1, h, end - begin] (C order).
std::vector<double> lse_columns(const Tensor& lse, std::int64_t begin, std::int64_t end) {
  const std::vector<double> x = to_doubles(lse);
  std::vector<double> y;
  for (std::int64_t head = 0; head < lse.size(0); ++head)
    for (std::int64_t t = begin; t < end; ++t) y.push_back(x[static_cast<std::size_t>(head * lse.size(1) + t)]);
  return y;
}

class VarlenMatchesPerSequence : public ::testing::TestWithParam<std::tuple<VarlenCase, Kernel, DType>> {};

// ---- (a) bit for bit the per-sequence call --------------------------------------------------------

TEST_P(VarlenMatchesPerSequence, ForwardAndBackwardBitwise) {
  const auto& [c, kernel, dtype] = GetParam();
  const std::vector<std::int64_t> cu_q = prefix_sums(c.L), cu_k = prefix_sums(c.S);
  const std::int64_t total_q = cu_q.back(), total_k = cu_k.back();
  Rng rng(20240617);
  const Tensor q = random_tensor(dtype, {total_q, c.h, c.d_k}, rng, -2, 2);  // [total_q, h, d_k]
  const Tensor k = random_tensor(dtype, {total_k, c.h_kv, c.d_k}, rng, -2, 2);
  const Tensor v = random_tensor(dtype, {total_k, c.h_kv, c.d_v}, rng);
  const Tensor dout = random_tensor(dtype, {total_q, c.h, c.d_v}, rng);
  const Tensor slopes = random_tensor(DType::Float32, {c.h}, rng, 0.05, 0.5);
  const Tensor sinks = random_tensor(DType::Float32, {c.h}, rng, -1, 2);
  AttentionOptions o;
  o.kernel = kernel, o.causal = c.causal, o.window_left = c.window_left, o.window_right = c.window_right;
  o.softcap = c.softcap, o.dropout_p = c.dropout_p, o.dropout_seed = 99, o.need_lse = true;
  if (c.alibi) o.alibi_slopes = slopes.view();
  if (c.sinks) o.sinks = sinks.view();

  const mha::VarlenResult packed = mha::varlen_attention(q, k, v, cu_q, cu_k, o);
  ASSERT_EQ(packed.out.shape(), (Shape{total_q, c.h, c.d_v}));
  ASSERT_EQ(packed.lse.shape(), (Shape{c.h, total_q}));
  const mha::AttentionGradients grads =
      mha::varlen_attention_backward(dout, q, k, v, packed.out, packed.lse, cu_q, cu_k, o);
  for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    const std::int64_t qb = cu_q[i], qe = cu_q[i + 1], kb = cu_k[i], ke = cu_k[i + 1];
    if (qe == qb) {  // no queries: its keys' gradients are 0 (the flash backward aborts on L = S = 0 alone)
      const auto zero = [](const std::vector<double>& x) {
        return std::all_of(x.begin(), x.end(), [](double e) { return e == 0.0; });
      };
      EXPECT_TRUE(zero(to_doubles(sequence_copy(grads.dk, kb, ke)))) << "dk";
      EXPECT_TRUE(zero(to_doubles(sequence_copy(grads.dv, kb, ke)))) << "dv";
      continue;
    }
    AttentionOptions oi = o;
    oi.dropout_query_offset = qb, oi.dropout_key_offset = kb;
    const Tensor qi = sequence_copy(q, qb, qe), ki = sequence_copy(k, kb, ke), vi = sequence_copy(v, kb, ke);
    const mha::AttentionResult alone = mha::scaled_dot_product_attention(qi, ki, vi, oi);
    EXPECT_TRUE(same_bits(to_doubles(sequence_copy(packed.out, qb, qe)), to_doubles(alone.out))) << "out";
    EXPECT_TRUE(same_bits(lse_columns(packed.lse, qb, qe), to_doubles(alone.lse))) << "lse";
    const mha::AttentionGradients g =
        mha::scaled_dot_product_attention_backward(sequence_copy(dout, qb, qe), qi, ki, vi, alone.out, alone.lse, oi);
    EXPECT_TRUE(same_bits(to_doubles(sequence_copy(grads.dq, qb, qe)), to_doubles(g.dq))) << "dq";
    EXPECT_TRUE(same_bits(to_doubles(sequence_copy(grads.dk, kb, ke)), to_doubles(g.dk))) << "dk";
    EXPECT_TRUE(same_bits(to_doubles(sequence_copy(grads.dv, kb, ke)), to_doubles(g.dv))) << "dv";
  }
}

std::string varlen_case_name(const ::testing::TestParamInfo<std::tuple<VarlenCase, Kernel, DType>>& info) {
  const auto& [c, kernel, dtype] = info.param;
  return std::string(c.name) + "_" + kernel_name(kernel) + "_" + short_name(dtype);
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenMatchesPerSequence,
                         ::testing::Combine(::testing::ValuesIn(varlen_cases()), ::testing::ValuesIn(kAllKernels),
                                            ::testing::Values(DType::Float32, DType::BFloat16, DType::Float64)),
                         varlen_case_name);

// ---- (b) refusals -----------------------------------------------------------------------------------

// A valid pack: 3 sequences, q [7, 4, 8], k [9, 2, 8], v [9, 2, 5].
constexpr std::int64_t kTotalQ = 7, kTotalK = 9, kH = 4, kHkv = 2, kDk = 8, kDv = 5;
const std::vector<std::int64_t> kCuQ{0, 3, 3, 7}, kCuK{0, 4, 6, 9};

Tensor T(Shape s, DType d = DType::Float32) { return Tensor(d, std::move(s)); }

void varlen(mha::CuSeqlens cu_q, mha::CuSeqlens cu_k, const AttentionOptions& o = {}) {
  (void)mha::varlen_attention(T({kTotalQ, kH, kDk}), T({kTotalK, kHkv, kDk}), T({kTotalK, kHkv, kDv}), cu_q, cu_k, o);
}
void varlen_with(void (*set)(AttentionOptions&)) {
  AttentionOptions o;
  set(o);
  varlen(kCuQ, kCuK, o);
}
void backward_with_lse(const Tensor& lse) {
  const Tensor dout = T({kTotalQ, kH, kDv}), out = T({kTotalQ, kH, kDv});
  (void)mha::varlen_attention_backward(dout, T({kTotalQ, kH, kDk}), T({kTotalK, kHkv, kDk}), T({kTotalK, kHkv, kDv}),
                                       out, lse, kCuQ, kCuK);
}

const Tensor& mask_storage() {
  static const Tensor mask(DType::Bool, {kTotalQ, kTotalK});
  return mask;
}

std::vector<BadCase> varlen_bad_cases() {
  std::vector<BadCase> c;
  c.push_back({"cu_q_not_from_0",
               [] {
                 varlen(std::vector<std::int64_t>{1, 3, 3, 7}, kCuK);
               },
               R"(^cu_seqlens_q: expected prefix sums starting at 0, got cu_seqlens_q\[0\] = 1$)"});
  c.push_back({"cu_q_decreasing",
               [] {
                 varlen(std::vector<std::int64_t>{0, 4, 3, 7}, kCuK);
               },
               R"(^cu_seqlens_q: .*non-decreasing.*cu_seqlens_q\[2\] = 3)"});
  c.push_back({"cu_q_wrong_end",
               [] {
                 varlen(std::vector<std::int64_t>{0, 3, 3, 6}, kCuK);
               },
               R"(^cu_seqlens_q: .*total_q = 7.*cu_seqlens_q\[3\] = 6)"});
  c.push_back({"cu_k_wrong_end_int32",
               [] {
                 varlen(kCuQ, std::vector<std::int32_t>{0, 4, 6, 10});
               },
               R"(^cu_seqlens_k: .*total_k = 9.*cu_seqlens_k\[3\] = 10)"});
  c.push_back({"cu_k_other_n",
               [] {
                 varlen(kCuQ, std::vector<std::int64_t>{0, 9});
               },
               R"(^cu_seqlens_k: expected n \+ 1 = 4 offsets)"});
  c.push_back({"cu_q_empty", [] { varlen(std::vector<std::int64_t>{}, kCuK); }, R"(^cu_seqlens_q: )"});
  c.push_back({"q_rank4",
               [] {
                 (void)mha::varlen_attention(T({1, kTotalQ, kH, kDk}), T({kTotalK, kHkv, kDk}), T({kTotalK, kHkv, kDv}),
                                             kCuQ, kCuK);
               },
               R"(^q: expected rank 3 \[total_q, h, d_k\])"});
  c.push_back(
      {"k_heads_do_not_divide",
       [] {
         (void)mha::varlen_attention(T({kTotalQ, kH, kDk}), T({kTotalK, 3, kDk}), T({kTotalK, 3, kDv}), kCuQ, kCuK);
       },
       R"(^k: .*h_kv)"});
  c.push_back({"attn_mask", [] { varlen_with([](AttentionOptions& o) { o.attn_mask = mask_storage().view(); }); },
               R"(^attn_mask: not taken by varlen_attention)"});
  c.push_back({"key_padding_mask",
               [] { varlen_with([](AttentionOptions& o) { o.key_padding_mask = mask_storage().view(); }); },
               R"(^key_padding_mask: not taken by varlen_attention)"});
  c.push_back({"key_lengths", [] { varlen_with([](AttentionOptions& o) {
                                     o.key_lengths = {1, 2, 3};
                                   }); },
               R"(^key_lengths: not taken by varlen_attention)"});
  c.push_back({"need_weights", [] { varlen_with([](AttentionOptions& o) { o.need_weights = true; }); },
               R"(^need_weights: not taken by varlen_attention)"});
  c.push_back({"dropout_p_1", [] { varlen_with([](AttentionOptions& o) { o.dropout_p = 1.0; }); }, R"(^dropout_p: )"});
  c.push_back({"backward_lse_batched_layout",
               [] {
                 backward_with_lse(T({1, kH, kTotalQ}));
               },
               R"(^lse: expected shape \[h, total_q\] = \[4, 7\])"});
  c.push_back({"backward_lse_float64",
               [] {
                 backward_with_lse(T({kH, kTotalQ}, DType::Float64));
               },
               R"(^lse: expected float32)"});
  return c;
}

class VarlenRefuses : public ::testing::TestWithParam<BadCase> {};

TEST_P(VarlenRefuses, NamingTheArgument) { expect_error_naming_the_argument(GetParam()); }

INSTANTIATE_TEST_SUITE_P(BadInput, VarlenRefuses, ::testing::ValuesIn(varlen_bad_cases()), bad_case_name);

}  // namespace
}  // namespace mha_test
