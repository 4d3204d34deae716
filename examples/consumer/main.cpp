// A program built against an installed mha (find_package(mha CONFIG) or pkg-config).
#include <cstdio>
#include <mha/mha.hpp>
#include <vector>

int main() {
  mha::MultiHeadAttention layer({.d_model = 8, .num_heads = 2}, /*seed=*/7);
  std::vector<float> x(3 * 8, 0.25f);  // [L=3, E=8], unbatched
  mha::TensorView input(x, {3, 8});
  auto [out, weights] = layer.forward(input, input, input);
  std::printf("consumer: out %s, weights %s\n", mha::shape_str(out.shape()).c_str(),
              mha::shape_str(weights.shape()).c_str());
}
