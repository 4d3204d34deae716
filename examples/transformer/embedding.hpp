// SharedEmbedding<T>: one [V, d_model] table used three times, as section 3.4 says: the source and
// target embeddings (multiplied by sqrt(d_model)) and the pre-softmax linear map (logits = h E^T).
// And the sinusoidal positional encoding of section 3.5.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "transformer/linear_products.hpp"
#include "transformer/parameter.hpp"

namespace transformer {

template <class T>
class SharedEmbedding {
 public:
  // Initialised N(0, 1 / d_model), so that sqrt(d_model) * E has entries of unit scale.
  // compute: the precision of the pre-softmax map's products (the lookup reads the table in T).
  SharedEmbedding(const std::string& name, std::int64_t vocab, std::int64_t d_model, Rng& rng,
                  Compute compute = Compute::Native)
      : table_(name, {vocab, d_model}), scale_(std::sqrt(static_cast<double>(d_model))), logits_products_(compute) {
    for (auto& v : table_.value) v = static_cast<T>(rng.normal() / scale_);
  }

  // ids [R] -> [R, d_model] = sqrt(d_model) * E[ids].
  Matrix<T> embed(const std::vector<int>& ids) const {
    Matrix<T> x(static_cast<std::int64_t>(ids.size()), d_model());
    for (std::int64_t r = 0; r < x.rows; ++r) {
      const T* e = table_.value.data() + ids[static_cast<std::size_t>(r)] * d_model();
      for (std::int64_t j = 0; j < x.cols; ++j) x(r, j) = static_cast<T>(scale_ * e[j]);
    }
    return x;
  }
  // dE[ids[r]] += sqrt(d_model) * dx[r].
  void embed_backward(const Matrix<T>& dx, const std::vector<int>& ids) {
    for (std::int64_t r = 0; r < dx.rows; ++r) {
      T* g = table_.grad.data() + ids[static_cast<std::size_t>(r)] * d_model();
      for (std::int64_t j = 0; j < dx.cols; ++j) g[j] += static_cast<T>(scale_ * dx(r, j));
    }
  }

  // h [R, d_model] -> logits [R, V] = h E^T. Keeps h for backward.
  Matrix<T> logits(const Matrix<T>& h) {
    Matrix<T> out(h.rows, vocab());
    logits_products_.forward(h, table_view(), out, /*accumulate=*/false);
    return out;
  }
  Matrix<T> apply_logits(const Matrix<T>& h) const {
    Matrix<T> out(h.rows, vocab());
    logits_products_.apply(h, table_view(), out, /*accumulate=*/false);
    return out;
  }
  // dlogits [R, V] -> dh [R, d_model] = dlogits E;  dE += dlogits^T h.
  Matrix<T> logits_backward(const Matrix<T>& dlogits) {
    Matrix<T> de(vocab(), d_model()), dh(dlogits.rows, d_model());
    logits_products_.backward(dlogits, de, dh);
    for (std::size_t i = 0; i < de.data.size(); ++i) table_.grad[i] += de.data[i];
    return dh;
  }

  void collect(ParameterRefs<T>& out) { out.push_back(&table_); }
  std::int64_t vocab() const { return table_.shape[0]; }
  std::int64_t d_model() const { return table_.shape[1]; }

 private:
  MatrixView<T> table_view() const { return {table_.value.data(), vocab(), d_model()}; }  // [V, d]

  Parameter<T> table_;
  double scale_;
  LinearProducts<T> logits_products_;  // h E^T and its gradients
};

// x [B * T, d] += PE[t] for the row of position t = first_position + (r mod T), where
//     PE(pos, 2i) = sin(pos / 10000^(2i / d)),   PE(pos, 2i + 1) = cos(pos / 10000^(2i / d)).
// No parameters, so its backward is the identity.
template <class T>
void add_positional_encoding(Matrix<T>& x, std::int64_t positions, std::int64_t first_position = 0) {
  const std::int64_t d = x.cols;
  Matrix<T> pe(positions, d);  // one row per position, added to every sequence of the batch
  for (std::int64_t t = 0; t < positions; ++t) {
    const double pos = static_cast<double>(first_position + t);
    for (std::int64_t i = 0; 2 * i < d; ++i) {
      const double angle = pos / std::pow(10000.0, static_cast<double>(2 * i) / static_cast<double>(d));
      pe(t, 2 * i) = static_cast<T>(std::sin(angle));
      if (2 * i + 1 < d) pe(t, 2 * i + 1) = static_cast<T>(std::cos(angle));
    }
  }
  for (std::int64_t r = 0; r < x.rows; ++r)
    for (std::int64_t j = 0; j < d; ++j) x(r, j) += pe(r % positions, j);
}

}  // namespace transformer
