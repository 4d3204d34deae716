// bfloat16 products through oneDNN's matmul primitive: oneDNN picks the implementation for the machine
// (AMX tiles or AVX512-BF16 dot products) and accumulates in float32. See gemm.hpp for the conventions.
//
// Where the CPU has no bfloat16 instructions, oneDNN 2.6 has no bf16 matmul at all (AVX2: "unimplemented")
// or only an emulation slower than sgemm (AVX-512 without BF16: 79 GFLOP/s against sgemm's 223 on one
// thread, measured on a Zen 5 with DNNL_MAX_CPU_ISA=AVX512_CORE). There the products run on sgemm
// over float32 copies of the operands: every bfloat16 value is exact in float32 and sgemm accumulates
// in float32, so the results are rounded at the same points (native_bfloat16() decides, once).
//
// A primitive is made for one shape (sizes, row strides, transposes, output dtype, alpha, overwrite or
// accumulate) and making one costs 0.3-13 ms (measured on a Zen 5), against microseconds for running
// a 128 x 256 x 64 product; so primitives are kept in a process-wide cache and made once per shape.
// Every primitive is planned for one thread and always runs on the calling thread (inside our
// parallel regions, or with one thread allowed), so results never depend on the thread count.
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gemm.hpp"
#include "gemm_blocks.hpp"
#include "mha/error.hpp"
#include "parallel.hpp"

namespace mha::detail {

namespace {

using dnnl::memory;

// Everything a matmul primitive is made for.
struct MatmulShape {
  std::int64_t M, N, K, lda, ldb, ldc;
  bool a_transposed, b_transposed, c_bfloat16, accumulate;
  float alpha;

  auto tie() const {
    return std::tie(M, N, K, lda, ldb, ldc, a_transposed, b_transposed, c_bfloat16, accumulate, alpha);
  }
  bool operator<(const MatmulShape& other) const { return tie() < other.tie(); }
};

struct Matmul {
  dnnl::matmul primitive;
  memory::desc a, b, c, scratchpad;
};

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// op(X) [rows, cols] of a row-major X with row stride ld (X is [cols, rows] when transposed).
memory::desc matrix(std::int64_t rows, std::int64_t cols, std::int64_t ld, bool transposed, memory::data_type type) {
  return memory::desc({rows, cols}, type, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

Matmul make_matmul(const MatmulShape& s) {
  const auto bf16 = memory::data_type::bf16;
  Matmul m{{},
           matrix(s.M, s.K, s.lda, s.a_transposed, bf16),
           matrix(s.K, s.N, s.ldb, s.b_transposed, bf16),
           matrix(s.M, s.N, s.ldc, false, s.c_bfloat16 ? bf16 : memory::data_type::f32),
           {}};
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per-thread scratch below, never shared
  if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
  if (s.accumulate) {
    dnnl::post_ops sum;
    sum.append_sum(1.0f);  // C = alpha A B + C, in float32, rounded once
    attr.set_post_ops(sum);
  }
  // Planned for one thread: oneDNN sizes its work split (possibly splitting K) by the thread count it
  // sees when the primitive is made.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  try {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m.a, m.b, m.c), attr, cpu_engine());
    m.primitive = dnnl::matmul(pd);
    m.scratchpad = pd.scratchpad_desc();
  } catch (...) {
    omp_set_num_threads(threads);
    throw;
  }
  omp_set_num_threads(threads);
  return m;
}

// The primitive for a shape, made on first use. At most kMaxCachedMatmuls are kept; beyond that the
// cache starts again (a handle stays valid while a caller holds its copy).
constexpr std::size_t kMaxCachedMatmuls = 512;

Matmul cached_matmul(const MatmulShape& s) {
  static std::mutex mutex;
  static std::map<MatmulShape, Matmul> cache;
  {
    const std::lock_guard lock(mutex);
    if (const auto found = cache.find(s); found != cache.end()) return found->second;
  }
  Matmul made = make_matmul(s);  // outside the lock: other threads' products go on meanwhile
  const std::lock_guard lock(mutex);
  if (cache.size() >= kMaxCachedMatmuls) cache.clear();
  return cache.emplace(s, std::move(made)).first->second;
}

// C (+)= alpha op(A) op(B) on the calling thread; C is bfloat16 or float32 as `c_bfloat16` says.
// Returns oneDNN's status (an exception cannot leave our parallel regions).
dnnl_status_t matmul_on_this_thread(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A,
                                    GemmInput<bfloat16> B, void* C, std::int64_t ldc, bool c_bfloat16, bool accumulate,
                                    float alpha) {
  try {
    const Matmul m =
        cached_matmul({M, N, K, A.ld, B.ld, ldc, A.transposed, B.transposed, c_bfloat16, accumulate, alpha});
    thread_local dnnl::stream stream(cpu_engine());
    thread_local std::vector<std::byte> scratch;
    if (scratch.size() < m.scratchpad.get_size()) scratch.resize(m.scratchpad.get_size());
    const auto& engine = cpu_engine();
    m.primitive.execute(stream, {{DNNL_ARG_SRC, memory(m.a, engine, const_cast<bfloat16*>(A.data))},
                                 {DNNL_ARG_WEIGHTS, memory(m.b, engine, const_cast<bfloat16*>(B.data))},
                                 {DNNL_ARG_DST, memory(m.c, engine, C)},
                                 {DNNL_ARG_SCRATCHPAD, memory(m.scratchpad, engine, scratch.data())}});
    return dnnl_success;
  } catch (const dnnl::error& e) {
    return e.status;
  }
}

// Below this many multiply-adds (M N K) a product runs on sgemm over widened operands even where the
// CPU has bf16 instructions: a matmul primitive's call costs about 1.4 us whatever its size, sgemm's
// about 0.4 us. Measured on a Zen 5, one thread, C = A B^T, bf16 matmul / widened sgemm (the sgemm
// alone, without the widening's ~0.1-0.3 us): 34 x 16 x 16: 1.44 / 0.44 us; 34 x 34 x 16: 1.75 / 0.71;
// 32^3: 1.51 / 0.78; 64 x 64 x 16: 1.64 / 1.24; 64 x 64 x 32: 1.87 / 2.04; 48^3: 1.86 / 2.39; 64^3:
// 2.54 / 3.66. (The demo's Transformer, d = 16 per head and ~34 positions, made 15,000 such calls a
// training step and ran 2.3x slower in bf16 than in float32 before this.)
constexpr std::int64_t kMinMatmulWork = 65536;

bool small_product(std::int64_t M, std::int64_t N, std::int64_t K) { return M * N * K < kMinMatmulWork; }

// Whether oneDNN runs bfloat16 products on the CPU's own bf16 instructions (AVX512-BF16, or AMX, whose
// ISA includes them): its effective ISA holds every bit of avx512_core_bf16 (the ISAs are bit sets).
bool native_bfloat16() {
  static const bool native = [] {
    const auto bf16 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core_bf16);
    return (static_cast<unsigned>(dnnl_get_effective_cpu_isa()) & bf16) == bf16;
  }();
  return native;
}

// The stored matrix of a bfloat16 operand, op(X) [rows, cols], widened into `out` (row stride: the
// stored width), as a float32 operand of the same orientation.
GemmInput<float> widened(std::int64_t rows, std::int64_t cols, GemmInput<bfloat16> X, std::vector<float>& out) {
  const std::int64_t stored_rows = X.transposed ? cols : rows, stored_cols = X.transposed ? rows : cols;
  out.resize(static_cast<std::size_t>(stored_rows * stored_cols));
  for (std::int64_t r = 0; r < stored_rows; ++r)
    for (std::int64_t c = 0; c < stored_cols; ++c)
      out[static_cast<std::size_t>(r * stored_cols + c)] = X.data[r * X.ld + c];
  return {out.data(), std::max<std::int64_t>(stored_cols, 1), X.transposed};
}

// The whole product through sgemm on widened operands (gemm<float>'s blocks, thread-count
// independent), C bfloat16 (through a float32 copy, rounded once) or float32.
template <class TC>
void gemm_widened(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                  GemmOutput<TC> C, float alpha) {
  std::vector<float> a, b;
  const GemmInput<float> A32 = widened(M, K, A, a), B32 = widened(K, N, B, b);
  if constexpr (std::is_same_v<TC, float>) {
    gemm<float>(M, N, K, A32, B32, C, alpha);
  } else {
    std::vector<float> c(static_cast<std::size_t>(M * N));
    for (std::int64_t m = 0; m < M && C.accumulate; ++m)
      for (std::int64_t n = 0; n < N; ++n) c[static_cast<std::size_t>(m * N + n)] = C.data[m * C.ld + n];
    gemm<float>(M, N, K, A32, B32, GemmOutput<float>{c.data(), N, C.accumulate}, alpha);
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n) C.data[m * C.ld + n] = c[static_cast<std::size_t>(m * N + n)];
  }
}

std::string describe_failure(dnnl_status_t status, std::int64_t M, std::int64_t N, std::int64_t K,
                             GemmInput<bfloat16> A, GemmInput<bfloat16> B, std::int64_t ldc) {
  return "internal error: oneDNN's bfloat16 matmul failed (status " + std::to_string(static_cast<int>(status)) +
         ") for M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " + std::to_string(K) + ", lda " +
         std::to_string(A.ld) + (A.transposed ? " (A^T)" : "") + ", ldb " + std::to_string(B.ld) +
         (B.transposed ? " (B^T)" : "") + ", ldc " + std::to_string(ldc);
}

// C = 0 for a product with nothing to sum (K = 0), unless it accumulates.
template <class TC>
void zero_unless_accumulating(std::int64_t M, std::int64_t N, GemmOutput<TC> C) {
  if (!C.accumulate)
    for (std::int64_t m = 0; m < M; ++m) std::fill_n(C.data + m * C.ld, N, TC(0.0f));
}

// The whole product on the library's threads, blocks as for float32 (gemm_blocks.hpp).
template <class TC>
void gemm_bf16_blocks(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                      GemmOutput<TC> C, float alpha) {
  if (M == 0 || N == 0) return;
  if (K == 0) return zero_unless_accumulating(M, N, C);
  if (!native_bfloat16() || small_product(M, N, K)) return gemm_widened(M, N, K, A, B, C, alpha);
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
  constexpr bool c_bfloat16 = std::is_same_v<TC, bfloat16>;
  const dnnl_status_t status = for_each_block(
      M, N, A, B, C, [&](std::int64_t rows, std::int64_t cols, auto A_rows, auto B_columns, auto C_block) {
        return matmul_on_this_thread(rows, cols, K, A_rows, B_columns, C_block.data, C.ld, c_bfloat16, C.accumulate,
                                     alpha);
      });
  if (status != dnnl_success) throw Error(describe_failure(status, M, N, K, A, B, C.ld));
}

}  // namespace

template <>
void gemm<bfloat16>(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                    GemmOutput<bfloat16> C, bfloat16 alpha) {
  gemm_bf16_blocks(M, N, K, A, B, C, alpha);
}

void gemm(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
          GemmOutput<float> C, float alpha) {
  gemm_bf16_blocks(M, N, K, A, B, C, alpha);
}

void gemm_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
               GemmOutput<float> C, float alpha) {
  if (M == 0 || N == 0) return;
  if (K == 0) return zero_unless_accumulating(M, N, C);
  if (!native_bfloat16() || small_product(M, N, K)) {  // sgemm on this thread's widened copies of the operands
    thread_local std::vector<float> a, b;
    return gemm_tile(M, N, K, widened(M, K, A, a), widened(K, N, B, b), C, alpha);
  }
  const dnnl_status_t status = matmul_on_this_thread(M, N, K, A, B, C.data, C.ld, false, C.accumulate, alpha);
  if (status == dnnl_success) return;
  // As gemm_tile for float32: a refused tile is a broken internal invariant; stop loudly.
  std::fprintf(stderr, "mha: %s\n", describe_failure(status, M, N, K, A, B, C.ld).c_str());
  std::abort();
}

std::string bf16_gemm_implementation() {
  const auto bf16 = memory::data_type::bf16;
  const memory::desc square({256, 256}, bf16, memory::dims{256, 1});
  std::string onednn;
  try {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(square, square, square), cpu_engine());
    onednn = pd.impl_info_str();
  } catch (const dnnl::error&) {
    onednn = "none";
  }
  if (native_bfloat16()) return "oneDNN matmul " + onednn;
  return "float32 sgemm on widened operands (no bf16 instructions; oneDNN's bf16 matmul here: " + onednn + ")";
}

}  // namespace mha::detail
