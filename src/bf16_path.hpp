// Which path runs the library's bfloat16 products (gemm_bf16.cpp), chosen once per process: oneDNN's
// matmul primitive on the CPU's bf16 instructions, or sgemm over float32 copies of the operands (every
// bfloat16 value is exact in float32, so both take bf16 operands, accumulate in float32 and round each
// product's result once). The instructions alone do not say which is faster: measured one thread,
// oneDNN's bf16 matmul runs at 5x sgemm with AMX and 1.8x on a Zen 5 (AVX512-BF16), but 0.5x on Intel
// Xeons with AVX512-BF16 and no AMX exposed (issue 32: 76-78 against 152-154 GFLOP/s). So where oneDNN
// has a native bf16 matmul both paths are timed once, at first use, on the fused kernels' tile products,
// and the faster is kept; the environment variable MHA_BF16_GEMM forces one.
//
// This header is the decision alone, a pure function of what was measured and requested, so that each
// kind of machine can be tested with faked rates (tests/cpp/gemm/bf16_path_test.cpp).
#pragma once

#include <optional>
#include <string>

namespace mha::detail {

enum class Bf16Path {
  OneDnnMatmul,  // oneDNN's matmul primitive: AMX tiles or AVX512-BF16 dot products
  WidenedSgemm,  // the operands widened to float32, then sgemm; the fused kernels run as float32 (attention.hpp)
};

// The variable that forces a path: "onednn", "sgemm" or "auto" (the default: measured), any case.
inline constexpr const char* kBf16PathVariable = "MHA_BF16_GEMM";

enum class Bf16PathRequest { Auto, OneDnnMatmul, WidenedSgemm, Invalid };

// MHA_BF16_GEMM's value read as a request: unset or empty is Auto; anything but the three names is
// Invalid (then ignored: the path is measured, and the description says so).
Bf16PathRequest parse_bf16_path_request(const std::optional<std::string>& value);

// GFLOP/s of the two paths on the same tile products, on one thread (gemm_bf16.cpp's measurement).
struct Bf16PathRates {
  double onednn_gflops, sgemm_gflops;
};

// oneDNN is kept unless sgemm is faster by more than this factor: within it the two are too close to
// tell apart on a shared machine, and a process should not flip between them from one run to the next
// (the paths sum in different orders, so their last bits differ). The machines measured so far are far
// from it (0.5x, 1.8x, 5x).
inline constexpr double kSgemmMustBeFasterBy = 1.10;

// What the decision is made from.
struct Bf16PathFacts {
  bool onednn_native;                  // oneDNN runs bf16 matmuls on the CPU's own bf16 instructions
  std::string onednn_implementation;   // its matmul's name here ("brg:avx512_core_amx_bf16"), or "none"
  std::optional<std::string> request;  // MHA_BF16_GEMM's value; nullopt when unset
  std::optional<Bf16PathRates> rates;  // measured where bf16_path_needs_rates; nullopt: the measurement failed
};

// Whether the decision needs the two paths measured: oneDNN is native here and no path is forced.
bool bf16_path_needs_rates(bool onednn_native, const std::optional<std::string>& request);

// The path, and a description of it with why it was chosen, e.g. "oneDNN matmul brg:avx512_core_amx_bf16
// (chosen: 1370 vs sgemm's 275 GFLOP/s, measured at first use)". Without a native oneDNN bf16 matmul it
// is always sgemm (forcing onednn falls back, and says so): oneDNN 2.6 has none at all on AVX2 and only
// an emulation at a third of sgemm's rate on AVX-512 without BF16 (gemm_bf16.cpp).
struct Bf16PathChoice {
  Bf16Path path;
  std::string description;
};

Bf16PathChoice choose_bf16_path(const Bf16PathFacts& facts);

}  // namespace mha::detail
