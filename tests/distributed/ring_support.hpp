// Helpers of the ring attention tests: the rank and size, seeded whole-sequence inputs that every
// rank builds alike, and conversions.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <random>
#include <vector>

#include "mha/distributed.hpp"

namespace ring_test {

using mha::DType;
using mha::Shape;
using mha::Tensor;
using mha::TensorView;

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

// A tensor of the shape with standard normal values from the seed (the same on every rank).
inline Tensor normal(DType dtype, const Shape& shape, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  Tensor t(dtype, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double x = dist(gen);
    if (dtype == DType::Float64) t.data_as<double>()[i] = x;
    else t.data_as<float>()[i] = static_cast<float>(x);
  }
  return t;
}

inline std::vector<double> doubles(const TensorView& t) {
  const Tensor c = Tensor::copy_of(t, DType::Float64);
  return {c.data_as<double>(), c.data_as<double>() + c.numel()};
}

}  // namespace ring_test
