// Runs a TorchScript model that calls mha's operators, from C++ with libtorch and mha_torch_ops only:
//
//     mha_libtorch_example model.pt inputs.pt out.bin
//
// model.pt: a module saved by torch.jit.save (scripted or traced) whose forward takes one tensor x.
// inputs.pt: a saved module holding that tensor as its attribute `x` (torch.jit.save of a scripted
//   module is the one file format that both Python's torch and libtorch 1.13 read).
// out.bin: written with the raw bytes of forward(x) and then of x's gradient of forward(x).sum(), both
//   contiguous, in their dtype: what the Python side compares bit for bit.
// Prints the shapes and the dtype.
#include <torch/script.h>

#include <cstdio>
#include <fstream>
#include <iostream>

namespace {

void write_bytes(std::ofstream& file, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  file.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s model.pt inputs.pt out.bin\n", argv[0]);
    return 2;
  }
  try {
    torch::jit::Module model = torch::jit::load(argv[1]);
    torch::jit::Module inputs = torch::jit::load(argv[2]);
    model.eval();
    const at::Tensor x = inputs.attr("x").toTensor().detach().requires_grad_(true);
    const at::Tensor out = model.forward({x}).toTensor();
    out.sum().backward();  // through mha's backward, registered with the operator
    std::ofstream file(argv[3], std::ios::binary);
    write_bytes(file, out.detach());
    write_bytes(file, x.grad());
    std::cout << "mha_libtorch_example: out " << out.sizes() << " " << out.scalar_type() << ", grad "
              << x.grad().sizes() << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha_libtorch_example: %s\n", e.what());
    return 1;
  }
  return 0;
}
