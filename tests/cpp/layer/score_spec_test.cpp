// The score's one description (mha/score.hpp) through the layer: MultiHeadAttentionInputs is a
// ScoreSpec, so every part of it reaches the kernels, the scale included (which the layer did not take
// before it held the description whole), and forward_paged passes its scale and variants to decode.
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"

namespace {

using mha::DType;
using mha::MultiHeadAttention;
using mha::Tensor;

TEST(ScoreSpec, TheLayersScaleEqualsQueryWeightsScaledByTheSameFactor) {
  // logits = (x W_q^T + b_q) . k * scale: scale c / sqrt(d_k) equals the default scale with W_q and b_q
  // multiplied by c. float64, so the two agree to rounding.
  const std::int64_t E = 8, h = 2, L = 3, S = 5;
  MultiHeadAttention layer({.d_model = E, .num_heads = h, .dtype = DType::Float64}, /*seed=*/3);
  std::vector<double> x(static_cast<std::size_t>(L * E)), y(static_cast<std::size_t>(S * E));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7 * static_cast<double>(i));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::cos(0.3 * static_cast<double>(i));
  const mha::TensorView query(x, {L, E}), key(y, {S, E});
  const double c = 2.5;
  mha::MultiHeadAttentionInputs scaled;
  scaled.scale = c / std::sqrt(static_cast<double>(E / h));
  scaled.causal = true;
  const Tensor with_scale = layer.forward(query, key, key, scaled).out;

  Tensor w = Tensor::copy_of(layer.parameter("in_proj_weight")), b = Tensor::copy_of(layer.parameter("in_proj_bias"));
  for (std::int64_t i = 0; i < E * E; ++i) w.data_as<double>()[i] *= c;  // the q rows come first
  for (std::int64_t i = 0; i < E; ++i) b.data_as<double>()[i] *= c;
  layer.set_parameter("in_proj_weight", w);
  layer.set_parameter("in_proj_bias", b);
  const Tensor with_weights = layer.forward(query, key, key, {{.causal = true}}).out;
  for (std::int64_t i = 0; i < with_scale.numel(); ++i)
    EXPECT_NEAR(with_scale.data_as<double>()[i], with_weights.data_as<double>()[i], 1e-12) << i;
}

TEST(ScoreSpec, ForwardPagedStepByStepEqualsOneCausalForwardWithTheSameScore) {
  // The score's variants reach decode through forward_paged: token t decoded alone equals row t of a
  // causal forward over the whole sequence with the same scale, window, ALiBi slopes and softcap, and
  // the layer's attention sinks when it has them.
  // and its rotary embedding (keys stored rotated, each new position at its index).
  for (const int variant : {0, 1, 2, 3}) {
    const bool sinks = variant == 1 || variant == 3;
    const std::int64_t E = 8, h = 2, T = 23, rotary_dim = variant >= 2 ? 4 : 0;
    MultiHeadAttention layer({.d_model = E,
                              .num_heads = h,
                              .sinks = sinks,
                              .rotary_dim = rotary_dim,
                              .rotary_interleaved = variant == 3,
                              .batch_first = true,
                              .dtype = DType::Float64},
                             5);
    std::vector<double> sink_values = {1.5, -0.5};
    if (sinks) layer.set_parameter("sinks", mha::TensorView(sink_values, {h}));
    std::vector<double> x(static_cast<std::size_t>(T * E)), slopes = {0.25, 0.0625};
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(1.3 * static_cast<double>(i));
    mha::MultiHeadAttentionInputs score;
    score.scale = 0.8, score.window_left = 5, score.softcap = 2.0;
    score.alibi_slopes = mha::TensorView(slopes, {h});
    mha::MultiHeadAttentionInputs whole = score;
    whole.causal = true;
    const Tensor full =
        layer
            .forward(mha::TensorView(x, {1, T, E}), mha::TensorView(x, {1, T, E}), mha::TensorView(x, {1, T, E}), whole)
            .out;  // [1, T, E]
    mha::PagedKVCache cache(layer.paged_cache_config(4, T));
    const std::vector<mha::PagedKVCache::SequenceId> ids = {cache.add_sequence()};
    for (std::int64_t t = 0; t < T; ++t) {
      const Tensor step = layer
                              .forward_paged(mha::TensorView(std::span<const double>(x).subspan(t * E, E), {1, 1, E}),
                                             cache, ids, score)
                              .out;
      for (std::int64_t e = 0; e < E; ++e)
        EXPECT_NEAR(step.data_as<double>()[e], full.data_as<double>()[t * E + e], 1e-12)
            << "variant " << variant << " t " << t << " e " << e;
    }
  }
}

TEST(ScoreSpec, ALayersSinksAreItsParameterNotAnInput) {
  MultiHeadAttention layer({.d_model = 4, .num_heads = 2, .sinks = true}, /*seed=*/1);
  std::vector<float> x(8, 0.5f), sinks = {0.0f, 1.0f};
  const mha::TensorView query(x, {2, 4});
  mha::MultiHeadAttentionInputs in;
  in.sinks = mha::TensorView(sinks, {2});
  try {
    layer.forward(query, query, query, in);
    FAIL() << "inputs.sinks was taken";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sinks: a layer's sinks are its parameter"), std::string::npos) << e.what();
  }
  EXPECT_EQ(layer.parameter("sinks").shape(), (mha::Shape{2}));
}

TEST(ScoreSpec, ScoresOutsideTheLogitDtypeAndMasksAreRefusedBeforeForwardPagedAppends) {
  MultiHeadAttention layer({.d_model = 4, .num_heads = 1}, /*seed=*/1);
  std::vector<float> x(4, 0.5f);
  const mha::TensorView query(x, {1, 4});
  mha::MultiHeadAttentionInputs in;
  in.scale = 1e39;  // not a float32
  EXPECT_THROW(layer.forward(query, query, query, in), mha::Error);
  mha::PagedKVCache cache(layer.paged_cache_config(4, 8));
  const std::vector<mha::PagedKVCache::SequenceId> ids = {cache.add_sequence()};
  const mha::TensorView step(x, {1, 1, 4});
  EXPECT_THROW(layer.forward_paged(step, cache, ids, in), mha::Error);
  mha::MultiHeadAttentionInputs causal;
  causal.causal = true;
  EXPECT_THROW(layer.forward_paged(step, cache, ids, causal), mha::Error);
  EXPECT_EQ(cache.length(ids[0]), 0);  // refused before anything was appended
  EXPECT_EQ(layer.forward_paged(step, cache, ids).out.shape(), (mha::Shape{1, 1, 4}));
}

TEST(ScoreSpec, ExplicitRotaryPositionsAreRefusedWhereTheLayerPlacesEachPositionItself) {
  // forward_cached and forward_paged rotate each new position at its index in its sequence: explicit
  // positions there would contradict the cache, so they are refused by name, before anything is appended.
  MultiHeadAttention layer({.d_model = 4, .num_heads = 1, .rotary_dim = 4}, /*seed=*/1);
  std::vector<float> x(4, 0.5f);
  const std::vector<std::int64_t> zero = {0};
  mha::MultiHeadAttentionInputs in;
  in.positions = mha::PositionsView(zero, {1});
  const mha::TensorView step(x, {1, 1, 4});
  mha::KeyValueCache kv;
  layer.append_to_cache(kv, step, step);
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const mha::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { layer.forward_cached(step, kv, in); }).find("positions: forward_cached takes no explicit"),
            std::string::npos);
  mha::PagedKVCache cache(layer.paged_cache_config(4, 8));
  const std::vector<mha::PagedKVCache::SequenceId> ids = {cache.add_sequence()};
  EXPECT_NE(message([&] { layer.forward_paged(step, cache, ids, in); }).find("positions: forward_paged takes no"),
            std::string::npos);
  EXPECT_EQ(cache.length(ids[0]), 0);  // refused before anything was appended
}

}  // namespace
