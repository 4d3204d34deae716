// What a training-mode forward keeps of its inputs for the backward (MultiHeadAttentionInputs::
// borrow_inputs and the sharing of one array passed in several roles):
//   (a) the gradients are bitwise the same whether the layer copies the inputs or borrows them, for
//       self-attention, key is value, and three distinct inputs, in float32 and float64;
//   (b) one array passed as query, key and value is kept once (saved_bytes counts one copy, not three),
//       and borrowed inputs are not copied at all, unless they have gaps between their rows;
//   (c) a borrowed input modified between forward and backward is refused with mha::Error naming it;
//       a copied one may change freely;
//   (d) the buffers a layer reuses from call to call (layer/buffer_pool.hpp) leak nothing: a sequence
//       of calls of changing shapes, inputs, masks and modes gives the bits of a fresh layer each time.
//
// Legend: B batch, L queries, S keys, E = d_model.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionGradients;
using mha::MultiHeadAttentionInputs;

MultiHeadAttentionConfig small_config(DType dtype) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 16, cfg.num_heads = 2, cfg.dtype = dtype;
  return cfg;
}

::testing::AssertionResult same_gradients(const MultiHeadAttentionGradients& a, const MultiHeadAttentionGradients& b) {
  for (auto [x, y, name] : {std::tuple{&a.query, &b.query, "query"}, std::tuple{&a.key, &b.key, "key"},
                            std::tuple{&a.value, &b.value, "value"}}) {
    auto r = bitwise_equal(*x, *y);
    if (!r) return r << " (gradient of " << name << ")";
  }
  for (const auto& [name, t] : a.parameters) {
    auto r = bitwise_equal(t, b.parameters.at(name));
    if (!r) return r << " (gradient of " << name << ")";
  }
  return ::testing::AssertionSuccess();
}

// ---- (a) copies and borrowed inputs give the same bits --------------------------------------------

class SavedInputsBitwise : public ::testing::TestWithParam<DType> {};

TEST_P(SavedInputsBitwise, CopiedAndBorrowedGiveTheSameGradients) {
  const DType dtype = GetParam();
  Rng rng(71);
  const Tensor x = random_tensor(dtype, {2, 5, 16}, rng), y = random_tensor(dtype, {2, 7, 16}, rng);
  const Tensor z = random_tensor(dtype, {2, 7, 16}, rng), dout = random_tensor(dtype, {2, 5, 16}, rng);
  struct Roles {
    const char* name;
    const Tensor *q, *k, *v;
  };
  for (const Roles& r : {Roles{"self", &x, &x, &x}, Roles{"key_is_value", &x, &y, &y}, Roles{"distinct", &x, &y, &z}}) {
    MultiHeadAttention copying(small_config(dtype), 3), borrowing(small_config(dtype), 3);
    MultiHeadAttentionInputs in;
    in.causal = true;
    const Tensor out_copied = copying.forward(*r.q, *r.k, *r.v, in).out;
    in.borrow_inputs = true;
    const Tensor out_borrowed = borrowing.forward(*r.q, *r.k, *r.v, in).out;
    EXPECT_TRUE(bitwise_equal(out_copied, out_borrowed)) << r.name;
    EXPECT_TRUE(same_gradients(copying.backward(dout), borrowing.backward(dout))) << r.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SavedInputsBitwise, ::testing::Values(DType::Float32, DType::Float64),
                         [](const auto& info) { return std::string(short_name(info.param)); });

// ---- (b) how many copies are kept -----------------------------------------------------------------

// saved_bytes() of a training-mode forward on (q, k, v).
std::int64_t saved_after(const TensorView& q, const TensorView& k, const TensorView& v, bool borrow) {
  MultiHeadAttention m(small_config(DType::Float32), 4);
  MultiHeadAttentionInputs in;
  in.borrow_inputs = borrow;
  (void)m.forward(q, k, v, in);
  return m.saved_bytes();
}

TEST(SavedInputs, SelfAttentionKeepsOneCopyAndBorrowingNone) {
  Rng rng(72);
  const Tensor x = random_tensor(DType::Float32, {2, 5, 16}, rng);
  const Tensor x2 = Tensor::copy_of(x), x3 = Tensor::copy_of(x);
  const std::int64_t input = static_cast<std::int64_t>(x.nbytes());
  const std::int64_t distinct_borrowed = saved_after(x, x2, x3, true);
  EXPECT_GT(distinct_borrowed, 0);
  EXPECT_EQ(saved_after(x, x2, x3, false), distinct_borrowed + 3 * input);
  EXPECT_EQ(saved_after(x, x, x, false), distinct_borrowed + input);  // one copy, not three
  EXPECT_EQ(saved_after(x, x, x, true), distinct_borrowed);
  EXPECT_EQ(saved_after(x, x2, x2, false), distinct_borrowed + 2 * input);  // key is value
}

TEST(SavedInputs, BorrowedInputsWithGapsAreCopiedOnce) {
  Rng rng(73);
  const Tensor wide = random_tensor(DType::Float32, {2, 5, 32}, rng);
  const TensorView x(wide.data(), DType::Float32, {2, 5, 16}, {160, 32, 1});  // every row has a gap
  const Tensor dense = Tensor::copy_of(x);
  const std::int64_t input = static_cast<std::int64_t>(dense.nbytes());
  EXPECT_EQ(saved_after(x, x, x, true), saved_after(dense, dense, dense, true) + input);
}

TEST(SavedInputs, EvalModeKeepsNothing) {
  Rng rng(74);
  const Tensor x = random_tensor(DType::Float32, {2, 5, 16}, rng);
  MultiHeadAttention m(small_config(DType::Float32), 5);
  (void)m.forward(x, x, x);
  EXPECT_GT(m.saved_bytes(), 0);
  m.eval();
  (void)m.forward(x, x, x);
  EXPECT_EQ(m.saved_bytes(), 0);
}

// ---- (c) a modified borrowed input is detected ------------------------------------------------------

TEST(SavedInputs, ModifiedBorrowedInputIsRefused) {
  Rng rng(75);
  Tensor x = random_tensor(DType::Float32, {2, 5, 16}, rng), y = random_tensor(DType::Float32, {2, 5, 16}, rng);
  const Tensor dout = random_tensor(DType::Float32, {2, 5, 16}, rng);
  MultiHeadAttention m(small_config(DType::Float32), 6);
  MultiHeadAttentionInputs in;
  in.borrow_inputs = true;

  (void)m.forward(x, x, x, in);
  const MultiHeadAttentionGradients before = m.backward(dout);
  x.data_as<float>()[37] += 1.0f;  // one element, after a backward that succeeded
  EXPECT_TRUE(throws_error_containing([&] { m.backward(dout); },
                                      "query (passed also as key and value) changed between forward and backward"));
  x.data_as<float>()[37] -= 1.0f;  // restored: the same bits again, so backward works
  EXPECT_TRUE(same_gradients(before, m.backward(dout)));

  (void)m.forward(x, y, y, in);
  y.data_as<float>()[y.numel() - 1] = -y.data_as<float>()[y.numel() - 1];  // the last element's sign
  EXPECT_TRUE(throws_error_containing([&] { m.backward(dout); }, "key (passed also as value) changed"));

  in.borrow_inputs = false;  // copies: the caller's arrays are free once forward() returns
  (void)m.forward(x, y, y, in);
  const MultiHeadAttentionGradients copied = m.backward(dout);
  x.data_as<float>()[0] = 1e6f;
  EXPECT_TRUE(same_gradients(copied, m.backward(dout)));
}

// ---- (d) reused buffers -------------------------------------------------------------------------------

TEST(SavedInputs, ReusedBuffersGiveTheBitsOfAFreshLayer) {
  // Buffers of at least BufferPool::kMinBytes (64 KiB): [256 rows, 64] float32 and larger.
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 64, cfg.num_heads = 2;
  cfg.add_zero_attn = true;  // extra key rows written after the projections
  MultiHeadAttention reused(cfg, 8);
  Rng rng(76);
  struct Step {
    std::int64_t B, L, S;
    bool training, mask_all_of_batch_0;
  };
  // The same shapes again (every buffer reused), other shapes, evaluation mode, and L and S swapped (a
  // query buffer reused as a key buffer and the other way round).
  for (const Step& step : {Step{4, 64, 79, true, false}, Step{4, 64, 79, true, true}, Step{4, 64, 79, false, false},
                           Step{5, 64, 79, true, false}, Step{4, 64, 79, true, false}, Step{4, 80, 63, true, true}}) {
    const Tensor q = random_tensor(DType::Float32, {step.B, step.L, 64}, rng, -3, 3);
    const Tensor kv = random_tensor(DType::Float32, {step.B, step.S, 64}, rng, -3, 3);
    const Tensor dout = random_tensor(DType::Float32, {step.B, step.L, 64}, rng);
    MultiHeadAttentionInputs in;
    if (step.mask_all_of_batch_0) {  // batch 0 sees only the zero position
      in.key_lengths.assign(static_cast<std::size_t>(step.B), step.S);
      in.key_lengths[0] = 0;
    }
    MultiHeadAttention fresh(cfg, 8);
    reused.train(step.training), fresh.train(step.training);
    const auto a = reused.forward(q, kv, kv, in), b = fresh.forward(q, kv, kv, in);
    EXPECT_TRUE(bitwise_equal(a.out, b.out)) << step.B << " " << step.L << " " << step.S;
    EXPECT_TRUE(bitwise_equal(a.weights, b.weights));
    if (step.training) {
      EXPECT_TRUE(same_gradients(reused.backward(dout), fresh.backward(dout)));
    }
  }
}

}  // namespace
}  // namespace mha_test
