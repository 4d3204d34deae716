// RingMultiHeadAttention against the single-process MultiHeadAttention: each rank builds the whole
// seeded problem and the same layer, runs its shard of the inputs, and checks its rows of the output and
// of the input gradients, and the parameter gradients (summed over the ranks), against the single
// process: float64 within 1e-12 x the magnitude, float32 within 4 x the single-process float32 error
// against float64 plus 1e-5 x the magnitude. Rotary layers (both pairings, partial and full rotary_dim,
// self and cross attention) check that each rank rotates its rows at their positions in the whole sequence.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <string>

#include "ring_support.hpp"

namespace ring_test {
namespace {

using mha::distributed::Layout;

struct LayerCase {
  const char* name;
  std::int64_t B, L, S, E, h, d_k, d_v, kdim, vdim;
  bool batch_first, bias, causal;
  Layout layout;
  bool padding = false, lengths = false;
  std::int64_t rotary_dim = 0;  // rotary embeddings of q and k heads (0: none), at base rotary_base
  bool rotary_interleaved = false;
  double rotary_base = 10000.0;
};
void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

const LayerCase kLayerCases[] = {
    {"self_causal_zigzag", 2, 37, 37, 16, 2, 0, 0, 0, 0, true, true, true, Layout::Zigzag},
    {"cross_sequence_first_padding", 2, 23, 31, 12, 3, 0, 0, 10, 7, false, true, false, Layout::Contiguous, true},
    {"own_widths_no_bias_lengths", 3, 29, 29, 12, 3, 5, 7, 0, 0, true, false, false, Layout::Zigzag, false, true},
    // Rotary: each rank's rows at their positions in the whole sequence (zigzag: two chunks each), query i
    // at i + S - L; a partial rotary_dim leaves the last d_k - rotary_dim features of each head as they are.
    {"rotary_half_causal_zigzag", 2, 37, 37, 16, 2, 0, 0, 0, 0, true, true, true, Layout::Zigzag, false, false, 4,
     false, 100.0},
    {"rotary_interleaved_cross_sequence_first_padding", 2, 23, 31, 12, 3, 6, 5, 10, 7, false, true, false,
     Layout::Contiguous, true, false, 4, true, 50.0},
    {"rotary_full_interleaved_cross_zigzag_lengths", 2, 19, 26, 12, 2, 0, 0, 0, 0, true, false, false, Layout::Zigzag,
     false, true, 6, true},
};

mha::MultiHeadAttentionConfig config_of(const LayerCase& c, DType dtype) {
  mha::MultiHeadAttentionConfig config;
  config.d_model = c.E, config.num_heads = c.h, config.d_k = c.d_k, config.d_v = c.d_v;
  config.kdim = c.kdim, config.vdim = c.vdim, config.bias = c.bias, config.batch_first = c.batch_first;
  config.dtype = dtype;
  config.rotary_dim = c.rotary_dim, config.rotary_interleaved = c.rotary_interleaved,
  config.rotary_base = c.rotary_base;
  return config;
}

// The layer of dtype, its parameters those of a float64 layer seeded alike (nonzero biases too).
mha::MultiHeadAttention make_layer(const LayerCase& c, DType dtype) {
  mha::MultiHeadAttention f64(config_of(c, DType::Float64), 11);
  mha::MultiHeadAttention layer(config_of(c, dtype), 11);
  std::uint64_t seed = 100;
  for (const std::string& name : f64.parameter_names()) {
    Tensor p = name.find("bias") != std::string::npos ? normal(DType::Float64, f64.parameter(name).shape(), seed++, 0.1)
                                                      : Tensor::copy_of(f64.parameter(name));
    layer.set_parameter(name, Tensor::copy_of(p, dtype));
  }
  return layer;
}

struct Problem {
  Tensor query, key, value, dout, padding;
  std::vector<std::int64_t> lengths;
};

Problem make_problem(const LayerCase& c, DType dtype) {
  auto shaped = [&](std::int64_t rows, std::int64_t width) {
    return c.batch_first ? mha::Shape{c.B, rows, width} : mha::Shape{rows, c.B, width};
  };
  Problem p{normal(dtype, shaped(c.L, c.E), 1),
            normal(dtype, shaped(c.S, c.kdim ? c.kdim : c.E), 2),
            normal(dtype, shaped(c.S, c.vdim ? c.vdim : c.E), 3),
            normal(dtype, shaped(c.L, c.E), 4),
            {},
            {}};
  if (c.padding) {
    p.padding = Tensor(DType::Bool, {c.B, c.S});
    auto* m = static_cast<bool*>(p.padding.data());
    for (std::int64_t i = 0; i < c.B * c.S; ++i) m[i] = (i * 7) % 5 == 0;
  }
  if (c.lengths)
    for (std::int64_t b = 0; b < c.B; ++b) p.lengths.push_back(b == 0 ? c.S : (b * 11) % c.S);
  return p;
}

struct Results {
  Tensor out, query, key, value;
  std::map<std::string, Tensor> parameters;
};

Results single_process(const LayerCase& c, mha::MultiHeadAttention& layer, const Problem& p) {
  mha::MultiHeadAttentionInputs in;
  if (p.padding.defined()) in.key_padding_mask = p.padding.view();
  in.key_lengths = p.lengths;
  in.causal = c.causal;
  in.need_weights = false;
  auto f = layer.forward(p.query, p.key, p.value, in);
  auto g = layer.backward(p.dout);
  return {std::move(f.out), std::move(g.query), std::move(g.key), std::move(g.value), std::move(g.parameters)};
}

Results ring(const LayerCase& c, mha::MultiHeadAttention& layer, const Problem& p) {
  const std::int64_t dim = c.batch_first ? 1 : 0;
  auto shard = [&](const Tensor& t, std::int64_t d) {
    return mha::distributed::shard_sequence(t, d, world_size(), world_rank(), c.layout);
  };
  const Tensor query = shard(p.query, dim), key = shard(p.key, dim), value = shard(p.value, dim),
               dout = shard(p.dout, dim);
  Tensor padding;
  mha::distributed::RingLayerInputs in;
  if (p.padding.defined()) padding = shard(p.padding, 1), in.key_padding_mask = padding.view();
  in.key_lengths = p.lengths;
  in.causal = c.causal;
  mha::distributed::RingMultiHeadAttention ring_layer(layer, MPI_COMM_WORLD, c.layout);
  Tensor out = ring_layer.forward(query, key, value, in);
  auto g = ring_layer.backward(dout);
  return {std::move(out), std::move(g.query), std::move(g.key), std::move(g.value), std::move(g.parameters)};
}

std::pair<double, double> error_and_magnitude(const TensorView& got, const TensorView& want) {
  const std::vector<double> g = doubles(got), w = doubles(want);
  double e = g.size() == w.size() ? 0 : HUGE_VAL, m = 1;
  for (std::size_t i = 0; i < std::min(g.size(), w.size()); ++i)
    e = std::max(e, std::isfinite(g[i]) ? std::fabs(g[i] - w[i]) : HUGE_VAL), m = std::max(m, std::fabs(w[i]));
  return {e, m};
}

class RingLayer : public ::testing::TestWithParam<std::tuple<LayerCase, DType>> {};

TEST_P(RingLayer, MatchesTheSingleProcessLayer) {
  const auto& [c, dtype] = GetParam();
  const std::int64_t dim = c.batch_first ? 1 : 0;
  mha::MultiHeadAttention layer = make_layer(c, dtype), layer64 = make_layer(c, DType::Float64);
  const Problem p = make_problem(c, dtype);
  Problem p64{Tensor::copy_of(p.query, DType::Float64),           Tensor::copy_of(p.key, DType::Float64),
              Tensor::copy_of(p.value, DType::Float64),           Tensor::copy_of(p.dout, DType::Float64),
              p.padding.defined() ? p.padding.clone() : Tensor(), p.lengths};
  const Results got = ring(c, layer, p), one = single_process(c, layer, p), ref = single_process(c, layer64, p64);
  auto mine = [&](const Tensor& t) {
    return mha::distributed::shard_sequence(t, dim, world_size(), world_rank(), c.layout);
  };
  auto check = [&](const std::string& name, const Tensor& have, const Tensor& single, const Tensor& want) {
    const auto [error, magnitude] = error_and_magnitude(have, want);
    const double allowed =
        dtype == DType::Float64 ? 1e-12 * magnitude : 4 * error_and_magnitude(single, want).first + 1e-5 * magnitude;
    EXPECT_LE(error, allowed) << name << ", rank " << world_rank() << " of " << world_size();
  };
  check("out", got.out, mine(one.out), mine(ref.out));
  check("query gradient", got.query, mine(one.query), mine(ref.query));
  check("key gradient", got.key, mine(one.key), mine(ref.key));
  check("value gradient", got.value, mine(one.value), mine(ref.value));
  ASSERT_EQ(got.parameters.size(), ref.parameters.size());
  for (const auto& [name, grad] : ref.parameters) check(name, got.parameters.at(name), one.parameters.at(name), grad);
}

TEST_P(RingLayer, SameBitsOnEveryRun) {
  const auto& [c, dtype] = GetParam();
  mha::MultiHeadAttention layer = make_layer(c, dtype);
  const Problem p = make_problem(c, dtype);
  const Results a = ring(c, layer, p), b = ring(c, layer, p);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.nbytes()), 0);
  for (const auto& [name, grad] : a.parameters)
    EXPECT_EQ(std::memcmp(grad.data(), b.parameters.at(name).data(), grad.nbytes()), 0) << name;
}

INSTANTIATE_TEST_SUITE_P(Cases, RingLayer,
                         ::testing::Combine(::testing::ValuesIn(kLayerCases),
                                            ::testing::Values(DType::Float32, DType::Float64)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  (std::get<1>(info.param) == DType::Float64 ? "_f64" : "_f32");
                         });

TEST(RingLayerErrors, OneRanksBadInputIsEveryRanksError) {
  const LayerCase c = kLayerCases[0];
  mha::MultiHeadAttention layer = make_layer(c, DType::Float32);
  mha::distributed::RingMultiHeadAttention ring_layer(layer, MPI_COMM_WORLD);
  const int bad = world_size() - 1;
  auto shard = [&](const Tensor& t) {
    return mha::distributed::shard_sequence(t, 1, world_size(), world_rank(), Layout::Zigzag);
  };
  const Tensor x = shard(normal(DType::Float32, {2, 20, 16}, 1)), narrow = shard(normal(DType::Float32, {2, 20, 8}, 1));
  std::string message;
  try {
    ring_layer.forward(x, world_rank() == bad ? narrow : x, x);
  } catch (const mha::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("RingMultiHeadAttention::forward: rank " + std::to_string(bad) + ": key: expected"),
            std::string::npos)
      << message;
  std::string backward_message;
  try {
    ring_layer.backward(x);
  } catch (const mha::Error& e) {
    backward_message = e.what();
  }
  EXPECT_NE(backward_message.find("rank 0: no training-mode forward"), std::string::npos) << backward_message;
  EXPECT_EQ(ring_layer.forward(x, x, x).shape(), x.shape());  // and the ring still works
}

TEST(RingLayerErrors, RanksWhoseLayersRotateDifferentlyAreToldSo) {
  // The rotary settings are the layer's, not an argument: a rank whose layer rotates otherwise would compute
  // other logits silently, so the agreement compares them and every rank gets the error.
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  LayerCase c = kLayerCases[0];
  c.rotary_dim = 4;
  c.rotary_interleaved = world_rank() == 1;
  mha::MultiHeadAttention layer = make_layer(c, DType::Float32);
  mha::distributed::RingMultiHeadAttention ring_layer(layer, MPI_COMM_WORLD);
  const Tensor x = mha::distributed::shard_sequence(normal(DType::Float32, {2, 20, 16}, 1), 1, world_size(),
                                                    world_rank(), Layout::Zigzag);
  std::string message;
  try {
    ring_layer.forward(x, x, x);
  } catch (const mha::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("rank 1: differs from rank 0 in rotary_interleaved true, rank 0 false"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace ring_test
