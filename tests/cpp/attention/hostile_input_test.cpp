// Inputs a careless or hostile caller hands the kernels, each of which once gave a wrong answer or a
// crash: rows with a stride of 0 or smaller than their width (oneDNN's sgemm refused them and the
// fused kernel read an untouched tile), NaN or overflowing logits that became numbers, and a value
// width whose per-thread scratch was sized for 128 query rows whatever the call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "mha/attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;
using mha::Kernel;
using mha::scaled_dot_product_attention;
using mha::scaled_dot_product_attention_backward;
using mha::Tensor;
using mha::TensorView;

// The same call on the same data, through views with degenerate row strides and through contiguous
// copies, on both kernels: equal to the reference on the copies, and repeatable.
struct StrideCase {
  const char* name;
  bool broadcast_query_rows;  // q [1, 2, L, d] whose L rows are one row (row stride 0)
  bool overlapping_keys;      // k, v rows one element apart (row stride 1 < width), a sliding window
};

class DegenerateRowStrides : public ::testing::TestWithParam<StrideCase> {};

TEST_P(DegenerateRowStrides, EqualContiguousCopiesForwardAndBackward) {
  const StrideCase c = GetParam();
  const std::int64_t B = 1, h = 2, L = 5, S = 9, d = 4;
  Rng rng(7);
  const std::vector<double> base = random_values(h * (S + d) * d, rng);
  Tensor storage = make_tensor(DType::Float32, {static_cast<std::int64_t>(base.size())}, base);
  const float* data = storage.data_as<float>();
  // q: [B, h, L, d]; with broadcast rows every query of a head is the same d floats.
  const TensorView q(data, DType::Float32, {B, h, L, d}, {h * d, d, c.broadcast_query_rows ? 0 : d, 1});
  // k, v: [B, h, S, d]; overlapping rows start one float apart (a sliding window over the data).
  const std::int64_t kv_row = c.overlapping_keys ? 1 : d;
  const TensorView k(data + 3, DType::Float32, {B, h, S, d}, {0, S + d, kv_row, 1});
  const TensorView v(data + 5, DType::Float32, {B, h, S, d}, {0, S + d, kv_row, 1});
  const Tensor qc = Tensor::copy_of(q), kc = Tensor::copy_of(k), vc = Tensor::copy_of(v);
  const Tensor dout = random_tensor(DType::Float32, {B, h, L, d}, rng);

  AttentionOptions ref;
  ref.kernel = Kernel::Reference;
  ref.need_lse = true;
  const auto want = scaled_dot_product_attention(qc.view(), kc.view(), vc.view(), ref);
  const auto want_grads = scaled_dot_product_attention_backward(dout.view(), qc.view(), kc.view(), vc.view(),
                                                                want.out.view(), want.lse.view(), ref);
  for (Kernel kernel : kAllKernels) {
    SCOPED_TRACE(kernel_name(kernel));
    AttentionOptions o = ref;
    o.kernel = kernel;
    const auto got = scaled_dot_product_attention(q, k, v, o);
    const auto again = scaled_dot_product_attention(q, k, v, o);
    EXPECT_TRUE(bitwise_equal(got.out, again.out)) << "repeated calls differ";
    EXPECT_TRUE(all_close(to_doubles(got.out.view()), to_doubles(want.out.view()), 1e-6, 1e-5));
    const auto grads = scaled_dot_product_attention_backward(dout.view(), q, k, v, got.out.view(), got.lse.view(), o);
    EXPECT_TRUE(all_close(to_doubles(grads.dq.view()), to_doubles(want_grads.dq.view()), 1e-5, 1e-4)) << "dq";
    EXPECT_TRUE(all_close(to_doubles(grads.dk.view()), to_doubles(want_grads.dk.view()), 1e-5, 1e-4)) << "dk";
    EXPECT_TRUE(all_close(to_doubles(grads.dv.view()), to_doubles(want_grads.dv.view()), 1e-5, 1e-4)) << "dv";
  }
}

INSTANTIATE_TEST_SUITE_P(Views, DegenerateRowStrides,
                         ::testing::Values(StrideCase{"broadcast_query", true, false},
                                           StrideCase{"overlapping_keys", false, true}, StrideCase{"both", true, true}),
                         [](const ::testing::TestParamInfo<StrideCase>& info) { return info.param.name; });

// Where a non-finite value sits, and which output rows it must reach (all others stay finite).
struct PoisonCase {
  const char* name;
  double scale_qk;  // q and k multiplied by this (1e20: every logit overflows to +inf)
  int nan_query_row;
  int nan_key;        // an allowed key's k holds NaN: every row attends to it
  double mask_entry;  // added at attn_mask[1, 1] (0: no mask)
};

class PoisonReachesItsRows : public KernelParamTest<PoisonCase> {};

TEST_P(PoisonReachesItsRows, NeverAsANumberAndWeightsAgree) {
  const PoisonCase c = param();
  const std::int64_t B = 1, h = 1, L = 3, S = 4, d = 4;
  Rng rng(11);
  std::vector<double> qv = random_values(L * d, rng), kv = random_values(S * d, rng);
  for (double& x : qv) x *= c.scale_qk;
  for (double& x : kv) x *= c.scale_qk;
  if (c.nan_query_row >= 0) qv[c.nan_query_row * d + 2] = kNaN;
  if (c.nan_key >= 0) kv[c.nan_key * d + 1] = kNaN;
  const Tensor q = make_tensor(DType::Float32, {B, h, L, d}, qv), k = make_tensor(DType::Float32, {B, h, S, d}, kv);
  const Tensor v = random_tensor(DType::Float32, {B, h, S, d}, rng);
  std::vector<double> mask(L * S, 0.0);
  mask[1 * S + 1] = c.mask_entry;
  mask[1 * S + 3] = -kInf;  // forbids key 3 for query 1: its weight stays exactly 0
  const Tensor attn_mask = make_tensor(DType::Float32, {L, S}, mask);
  AttentionOptions o = options();
  o.need_weights = o.need_lse = true;
  if (c.mask_entry != 0) o.attn_mask = attn_mask.view();
  const auto r = scaled_dot_product_attention(q.view(), k.view(), v.view(), o);
  const std::vector<double> out = to_doubles(r.out.view()), w = to_doubles(r.weights.view());
  const std::vector<double> lse = to_doubles(r.lse.view());
  for (std::int64_t i = 0; i < L; ++i) {
    const bool poisoned = c.scale_qk > 1 || c.nan_key >= 0 || i == c.nan_query_row || (c.mask_entry != 0 && i == 1);
    bool row_finite = true;
    for (std::int64_t e = 0; e < d; ++e) row_finite = row_finite && std::isfinite(out[i * d + e]);
    EXPECT_EQ(row_finite, !poisoned) << "output row " << i;
    EXPECT_EQ(std::isfinite(lse[i]), !poisoned) << "lse row " << i;
    for (std::int64_t j = 0; j < S; ++j) {
      const bool forbidden = c.mask_entry != 0 && i == 1 && j == 3;
      if (forbidden) EXPECT_EQ(w[i * S + j], 0.0) << "weight of a forbidden key, row " << i;
      else EXPECT_EQ(std::isfinite(w[i * S + j]), !poisoned) << "weight " << i << ", " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, PoisonReachesItsRows,
                         ::testing::Combine(::testing::Values(PoisonCase{"nan_query_row", 1, 1, -1, 0},
                                                              PoisonCase{"nan_allowed_key", 1, -1, 2, 0},
                                                              PoisonCase{"logits_overflow", 1e20, -1, -1, 0},
                                                              PoisonCase{"plus_inf_mask_entry", 1, -1, -1, kInf},
                                                              PoisonCase{"nan_mask_entry", 1, -1, -1, kNaN}),
                                            ::testing::ValuesIn(kAllKernels)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  kernel_name(std::get<1>(info.param));
                         });

// One query, two keys and values 2^23 wide: the fused kernel's scratch is sized for the rows the call
// has (it was sized for 128 rows whatever L: 4 GiB per thread here, and a failed allocation was written
// through). The result equals the reference's.
TEST(WideValues, ScratchSizedToTheCall) {
  const std::int64_t d_v = std::int64_t{1} << (kUnderSanitizers ? 21 : 23);
  Rng rng(3);
  const Tensor q = random_tensor(DType::Float32, {1, 1, 1, 2}, rng),
               k = random_tensor(DType::Float32, {1, 1, 2, 2}, rng);
  const Tensor v = random_tensor(DType::Float32, {1, 1, 2, d_v}, rng);
  AttentionOptions flash, reference;
  reference.kernel = Kernel::Reference;
  const auto got = scaled_dot_product_attention(q.view(), k.view(), v.view(), flash);
  const auto want = scaled_dot_product_attention(q.view(), k.view(), v.view(), reference);
  EXPECT_TRUE(all_close(to_doubles(got.out.view()), to_doubles(want.out.view()), 1e-6, 1e-5));
}

}  // namespace
}  // namespace mha_test
