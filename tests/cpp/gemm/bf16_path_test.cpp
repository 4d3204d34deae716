// The path of the bfloat16 products (src/bf16_path.hpp, src/gemm_bf16.cpp):
// - the decision for each kind of machine, from faked rates (nothing here times anything): AMX-like
//   (oneDNN at 5x sgemm), Zen 5-like (1.8x), Intel without AMX (0.5x), no bf16 instructions, the margin
//   on both sides, a failed measurement; MHA_BF16_GEMM forcing either path, and an invalid value;
// - the path this process runs, as MHA_BF16_GEMM says (the ctest entries bfloat16_gemm_sgemm and
//   bfloat16_gemm_onednn run these tests with each forced), decided without changing the thread count;
// - its products at the fused kernels' tile shapes within float32 rounding of the float64 product of the
//   same bfloat16 operands, through gemm_tile and gemm, overwriting and accumulating.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_path.hpp"
#include "gemm.hpp"

namespace mha_test {
namespace {

using mha::bfloat16;
using mha::detail::bf16_path_needs_rates;
using mha::detail::Bf16Path;
using mha::detail::Bf16PathChoice;
using mha::detail::Bf16PathFacts;
using mha::detail::Bf16PathRates;
using mha::detail::Bf16PathRequest;
using mha::detail::choose_bf16_path;
using mha::detail::parse_bf16_path_request;

constexpr const char* kAmx = "brg:avx512_core_amx_bf16";
constexpr const char* kAvx512Bf16 = "brg:avx512_core_bf16";

// A machine whose oneDNN runs bf16 natively as `implementation`, its two paths measured at these rates.
Bf16PathFacts measured(const char* implementation, double onednn_gflops, double sgemm_gflops,
                       std::optional<std::string> request = std::nullopt) {
  return {true, implementation, std::move(request), Bf16PathRates{onednn_gflops, sgemm_gflops}};
}

// A machine without bf16 instructions: oneDNN's matmul is an emulation (AVX-512) or absent (AVX2).
Bf16PathFacts without_bf16(const char* implementation, std::optional<std::string> request = std::nullopt) {
  return {false, implementation, std::move(request), std::nullopt};
}

TEST(Bfloat16GemmPathChoice, AmxLikeKeepsOneDnnAtFiveTimesSgemm) {
  const Bf16PathChoice c = choose_bf16_path(measured(kAmx, 1370, 275));
  EXPECT_EQ(c.path, Bf16Path::OneDnnMatmul);
  EXPECT_EQ(c.description,
            "oneDNN matmul brg:avx512_core_amx_bf16 (chosen: 1370 vs sgemm's 275 GFLOP/s, measured at first use)");
}

TEST(Bfloat16GemmPathChoice, Zen5LikeKeepsOneDnnAt1Point8TimesSgemm) {
  const Bf16PathChoice c = choose_bf16_path(measured(kAvx512Bf16, 400, 222));
  EXPECT_EQ(c.path, Bf16Path::OneDnnMatmul);
  EXPECT_EQ(c.description,
            "oneDNN matmul brg:avx512_core_bf16 (chosen: 400 vs sgemm's 222 GFLOP/s, measured at first use)");
}

TEST(Bfloat16GemmPathChoice, IntelWithoutAmxLikeTakesSgemmAtHalfItsRate) {
  const Bf16PathChoice c = choose_bf16_path(measured(kAvx512Bf16, 77, 153));
  EXPECT_EQ(c.path, Bf16Path::WidenedSgemm);
  EXPECT_EQ(c.description,
            "sgemm over widened operands (chosen: 153 vs oneDNN matmul brg:avx512_core_bf16's 77 GFLOP/s, measured "
            "at first use)");
}

TEST(Bfloat16GemmPathChoice, NoBf16InstructionsTakesSgemmUnmeasured) {
  for (const char* implementation : {"brg:avx512_core", "none"}) {  // AVX-512 emulation; AVX2: none at all
    EXPECT_FALSE(bf16_path_needs_rates(false, std::nullopt));
    const Bf16PathChoice c = choose_bf16_path(without_bf16(implementation));
    EXPECT_EQ(c.path, Bf16Path::WidenedSgemm);
    EXPECT_EQ(c.description, "sgemm over widened operands (no bf16 instructions; oneDNN's bf16 matmul here: " +
                                 std::string(implementation) + ")");
  }
}

TEST(Bfloat16GemmPathChoice, OneDnnKeptUnlessSgemmIsOver10PercentFaster) {
  const Bf16PathChoice close = choose_bf16_path(measured(kAvx512Bf16, 200, 219));
  EXPECT_EQ(close.path, Bf16Path::OneDnnMatmul);
  EXPECT_EQ(close.description,
            "oneDNN matmul brg:avx512_core_bf16 (chosen: 200 vs sgemm's 219 GFLOP/s, measured at first use, sgemm not "
            "10% faster)");
  EXPECT_EQ(choose_bf16_path(measured(kAvx512Bf16, 200, 220)).path, Bf16Path::OneDnnMatmul);  // exactly 1.10x
  EXPECT_EQ(choose_bf16_path(measured(kAvx512Bf16, 200, 221)).path, Bf16Path::WidenedSgemm);
  EXPECT_EQ(choose_bf16_path(measured(kAvx512Bf16, 200, 200)).path, Bf16Path::OneDnnMatmul);
}

TEST(Bfloat16GemmPathChoice, FailedMeasurementTakesSgemmAndSaysSo) {
  Bf16PathFacts facts = measured(kAvx512Bf16, 0, 0);
  facts.rates = std::nullopt;
  const Bf16PathChoice c = choose_bf16_path(facts);
  EXPECT_EQ(c.path, Bf16Path::WidenedSgemm);
  EXPECT_EQ(
      c.description,
      "sgemm over widened operands (oneDNN matmul brg:avx512_core_bf16 failed when it was measured at first use)");
}

TEST(Bfloat16GemmPathChoice, EnvironmentReadAsARequestInAnyCase) {
  EXPECT_EQ(parse_bf16_path_request(std::nullopt), Bf16PathRequest::Auto);
  EXPECT_EQ(parse_bf16_path_request(""), Bf16PathRequest::Auto);
  EXPECT_EQ(parse_bf16_path_request("auto"), Bf16PathRequest::Auto);
  EXPECT_EQ(parse_bf16_path_request("AUTO"), Bf16PathRequest::Auto);
  EXPECT_EQ(parse_bf16_path_request("onednn"), Bf16PathRequest::OneDnnMatmul);
  EXPECT_EQ(parse_bf16_path_request("oneDNN"), Bf16PathRequest::OneDnnMatmul);
  EXPECT_EQ(parse_bf16_path_request("sgemm"), Bf16PathRequest::WidenedSgemm);
  EXPECT_EQ(parse_bf16_path_request("SGEMM"), Bf16PathRequest::WidenedSgemm);
  for (const char* bad : {"amx", "one dnn", " sgemm", "sgemm,onednn", "1"})
    EXPECT_EQ(parse_bf16_path_request(bad), Bf16PathRequest::Invalid) << bad;
}

TEST(Bfloat16GemmPathChoice, ForcedPathsWinOverAnyRates) {
  EXPECT_FALSE(bf16_path_needs_rates(true, "sgemm"));
  EXPECT_FALSE(bf16_path_needs_rates(true, "onednn"));
  EXPECT_TRUE(bf16_path_needs_rates(true, "auto"));
  EXPECT_TRUE(bf16_path_needs_rates(true, std::nullopt));
  Bf16PathFacts amx = measured(kAmx, 1370, 275, "sgemm");
  amx.rates = std::nullopt;  // not measured when forced
  const Bf16PathChoice sgemm = choose_bf16_path(amx);
  EXPECT_EQ(sgemm.path, Bf16Path::WidenedSgemm);
  EXPECT_EQ(sgemm.description, "sgemm over widened operands (forced by MHA_BF16_GEMM=sgemm)");
  Bf16PathFacts no_amx = measured(kAvx512Bf16, 77, 153, "onednn");
  no_amx.rates = std::nullopt;
  const Bf16PathChoice onednn = choose_bf16_path(no_amx);
  EXPECT_EQ(onednn.path, Bf16Path::OneDnnMatmul);
  EXPECT_EQ(onednn.description, "oneDNN matmul brg:avx512_core_bf16 (forced by MHA_BF16_GEMM=onednn)");
  EXPECT_EQ(choose_bf16_path(without_bf16("none", "sgemm")).description,
            "sgemm over widened operands (forced by MHA_BF16_GEMM=sgemm)");
}

TEST(Bfloat16GemmPathChoice, ForcedOneDnnWithoutBf16InstructionsFallsBackToSgemmAndSaysSo) {
  const Bf16PathChoice c = choose_bf16_path(without_bf16("none", "onednn"));
  EXPECT_EQ(c.path, Bf16Path::WidenedSgemm);
  EXPECT_EQ(c.description,
            "sgemm over widened operands (MHA_BF16_GEMM=onednn, but oneDNN has no bf16 matmul on this CPU's own "
            "instructions; oneDNN's bf16 matmul here: none)");
}

TEST(Bfloat16GemmPathChoice, InvalidValueIsIgnoredAndNamed) {
  EXPECT_TRUE(bf16_path_needs_rates(true, "fast"));
  EXPECT_FALSE(bf16_path_needs_rates(false, "fast"));
  const Bf16PathChoice c = choose_bf16_path(measured(kAvx512Bf16, 77, 153, "fast"));
  EXPECT_EQ(c.path, Bf16Path::WidenedSgemm);
  EXPECT_EQ(c.description,
            "sgemm over widened operands (chosen: 153 vs oneDNN matmul brg:avx512_core_bf16's 77 GFLOP/s, measured "
            "at first use; MHA_BF16_GEMM=fast ignored: not onednn, sgemm or auto)");
  EXPECT_EQ(choose_bf16_path(measured(kAmx, 1370, 275, "fast")).path, Bf16Path::OneDnnMatmul);
}

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The decision is made here if no product of this process made it before (run alone, as the ctest entry
// bfloat16_gemm_path_first_use does: inside a parallel region, where it must not throw or change the count).
TEST(Bfloat16GemmPath, IsTheOneForcedOrMeasuredAndLeavesTheThreadCount) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  std::string description;
  Bf16Path path{};
  int before = 0, after = 0;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    {
      before = omp_get_max_threads();
      description = mha::detail::bf16_gemm_implementation();
      path = mha::detail::bf16_gemm_path();
      after = omp_get_max_threads();
    }
  }
  EXPECT_EQ(after, before);  // inside the region, untouched
  EXPECT_EQ(omp_get_max_threads(), 2);
  omp_set_num_threads(saved);
  std::printf("[ bf16 path ] %s\n", description.c_str());
  const std::string name = path == Bf16Path::OneDnnMatmul ? "oneDNN matmul " : "sgemm over widened operands (";
  EXPECT_TRUE(starts_with(description, name)) << description;
  const char* value = std::getenv("MHA_BF16_GEMM");
  const Bf16PathRequest request = parse_bf16_path_request(value ? std::optional<std::string>(value) : std::nullopt);
  if (request == Bf16PathRequest::WidenedSgemm) {
    EXPECT_EQ(path, Bf16Path::WidenedSgemm);
    EXPECT_TRUE(contains(description, std::string("(forced by MHA_BF16_GEMM=") + value + ")")) << description;
  } else if (request == Bf16PathRequest::OneDnnMatmul) {  // forced, or the fallback without bf16 instructions
    EXPECT_TRUE(contains(description, std::string("MHA_BF16_GEMM=") + value)) << description;
    if (path == Bf16Path::OneDnnMatmul) {
      EXPECT_TRUE(contains(description, "(forced by")) << description;
    }
  } else {
    EXPECT_TRUE(contains(description, "measured at first use") || contains(description, "no bf16 instructions"))
        << description;
  }
}

// A tile product as the fused kernels make them, and the float64 product of the same operands.
struct TileCase {
  const char* name;
  std::int64_t M, N, K;
  bool a_transposed, b_transposed, accumulate;
  float alpha;
};

// The operands, in bfloat16 on a random draw; C starts random too (what accumulating adds to).
struct TileOperands {
  std::vector<bfloat16> A, B;
  std::vector<float> C;
};

TileOperands make_operands(const TileCase& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  TileOperands o;
  for (std::int64_t i = 0; i < c.M * c.K; ++i) o.A.push_back(bfloat16(u(rng)));
  for (std::int64_t i = 0; i < c.K * c.N; ++i) o.B.push_back(bfloat16(u(rng)));
  for (std::int64_t i = 0; i < c.M * c.N; ++i) o.C.push_back(u(rng));
  return o;
}

// Every element of `got` within float32 accumulation's bound of the float64 product of the operands,
// (K + 2) 2^-24 times the sum of the magnitudes, in any order of summation; for a bfloat16 C also one
// rounding to bfloat16 (2^-8 relative).
template <class TC>
void expect_within_float32_rounding(const TileCase& c, const TileOperands& o, const std::vector<TC>& got) {
  const std::int64_t lda = c.a_transposed ? c.M : c.K, ldb = c.b_transposed ? c.K : c.N;
  int failures = 0;
  for (std::int64_t m = 0; m < c.M; ++m)
    for (std::int64_t n = 0; n < c.N; ++n) {
      double sum = 0, size = 0;
      for (std::int64_t k = 0; k < c.K; ++k) {
        const double a = float(c.a_transposed ? o.A[k * lda + m] : o.A[m * lda + k]);
        const double b = float(c.b_transposed ? o.B[n * ldb + k] : o.B[k * ldb + n]);
        sum += a * b, size += std::fabs(a * b);
      }
      const double before = c.accumulate ? static_cast<double>(float(TC(o.C[m * c.N + n]))) : 0.0;
      const double want = before + c.alpha * sum, magnitude = std::fabs(before) + std::fabs(c.alpha) * size;
      double bound = (c.K + 2) * std::ldexp(magnitude, -24);
      if constexpr (std::is_same_v<TC, bfloat16>) bound += std::ldexp(std::fabs(want), -8);
      const double error = std::fabs(static_cast<double>(float(got[m * c.N + n])) - want);
      if (error > bound && ++failures <= 3)
        ADD_FAILURE() << c.name << " [" << m << ", " << n << "]: " << float(got[m * c.N + n]) << " vs " << want;
    }
}

// The kernels' tiles (flash_forward.cpp, flash_backward.cpp) at d = 64 and 128: S = scale Q K^T, acc += P V,
// dV = P^T dO (overwritten on the first query block, accumulated after), dQ += scale dS K, dK += scale dS^T Q.
std::vector<TileCase> tile_cases() {
  std::vector<TileCase> all;
  for (const std::int64_t d : {64, 128}) {
    all.push_back({"S = scale Q K^T", 128, 256, d, false, true, false, 0.125f});
    all.push_back({"acc += P V", 128, d, 256, false, false, true, 1.0f});
    all.push_back({"dV = P^T dO", 256, d, 128, true, false, false, 1.0f});
    all.push_back({"dV += P^T dO", 256, d, 128, true, false, true, 1.0f});
    all.push_back({"dQ += scale dS K", 128, d, 256, false, false, true, 0.125f});
    // A diagonal band's and a last block's shapes: with AMX, gemm_tile copies the transposed operand plain
    // (bf16_transpose.hpp), here off its 32 x 32 blocks
    all.push_back({"dK += scale dS^T Q, a band", 200, d, 77, true, false, true, 0.125f});
    all.push_back({"dV = P^T dO, ragged", 257, d, 131, true, false, false, 1.0f});
  }
  return all;
}

TEST(Bfloat16GemmProduct, TilesWithinFloat32RoundingOnThisProcesssPath) {
  for (const TileCase& c : tile_cases()) {
    SCOPED_TRACE(std::string(c.name) + ", K " + std::to_string(c.K) + ", N " + std::to_string(c.N));
    const TileOperands o = make_operands(c, 11);
    std::vector<float> tile = o.C, whole = o.C;
    const std::int64_t lda = c.a_transposed ? c.M : c.K, ldb = c.b_transposed ? c.K : c.N;
    const mha::detail::GemmInput<bfloat16> A{o.A.data(), lda, c.a_transposed}, B{o.B.data(), ldb, c.b_transposed};
    mha::detail::gemm_tile(c.M, c.N, c.K, A, B, {tile.data(), c.N, c.accumulate}, c.alpha);
    mha::detail::gemm(c.M, c.N, c.K, A, B, {whole.data(), c.N, c.accumulate}, c.alpha);
    expect_within_float32_rounding(c, o, tile);
    expect_within_float32_rounding(c, o, whole);
    std::vector<bfloat16> rounded(o.C.begin(), o.C.end());  // gemm<bfloat16>: C rounded once
    mha::detail::gemm<bfloat16>(c.M, c.N, c.K, A, B, {rounded.data(), c.N, c.accumulate}, bfloat16(c.alpha));
    expect_within_float32_rounding(c, o, rounded);
  }
}

}  // namespace
}  // namespace mha_test
