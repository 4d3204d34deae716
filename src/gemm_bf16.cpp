// bfloat16 products through oneDNN's matmul primitive: oneDNN picks the implementation for the machine
// (AMX tiles or AVX512-BF16 dot products) and accumulates in float32. See gemm.hpp for the conventions.
//
// Or through sgemm over float32 copies of the operands: every bfloat16 value is exact in float32 and
// sgemm accumulates in float32, so the results are rounded at the same points (gemm_bf16_widened.cpp). Which of the two
// runs is chosen once per process (bf16_path.hpp, bf16_path_choice below). Where the CPU has no bfloat16 instructions
// it is always sgemm: oneDNN 2.6 has no bf16 matmul at all (AVX2: "unimplemented") or only an emulation slower than
// sgemm (AVX-512 without BF16: 79 GFLOP/s against sgemm's 223 on one thread, measured on a Zen 5 with
// DNNL_MAX_CPU_ISA=AVX512_CORE). Where it has them, the two paths are timed on the fused kernels' tiles at first use,
// because the ISA does not say which is faster (bf16_path.hpp).
//
// A primitive is made for one shape (sizes, row strides, transposes, output dtype, alpha, overwrite or
// accumulate) and making one costs 0.3-13 ms (measured on a Zen 5), against microseconds for running
// a 128 x 256 x 64 product; so primitives are kept in a process-wide cache and made once per shape.
// Every primitive is planned for one thread and always runs on the calling thread (inside our
// parallel regions, or with one thread allowed), so results never depend on the thread count.
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention/bf16_transpose.hpp"
#include "attention/flash_config.hpp"
#include "attention/query_block.hpp"
#include "bf16_path.hpp"
#include "gemm.hpp"
#include "gemm_bf16_widened.hpp"
#include "gemm_blocks.hpp"
#include "hwy/aligned_allocator.h"
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

// One thread's handles for a shape: the shared primitive and memory objects of its own, which each call
// points at its operands (set_data_handle) instead of making four new ones. Found without a lock: a
// fused kernel calls the same two or three shapes thousands of times a second on every thread, and the
// mutex, the four memory objects and the argument map cost about as much as a 128 x 256 x 64 product's
// last tenth (measured in PERFORMANCE.md, issue 32).
struct ThreadMatmul {
  Matmul held;
  memory a, b, c, scratchpad;
};

ThreadMatmul& thread_matmul(const MatmulShape& s) {
  thread_local std::map<MatmulShape, ThreadMatmul> mine;
  if (const auto found = mine.find(s); found != mine.end()) return found->second;
  if (mine.size() >= kMaxCachedMatmuls) mine.clear();
  Matmul m = cached_matmul(s);
  const auto& engine = cpu_engine();
  ThreadMatmul t{m, memory(m.a, engine, DNNL_MEMORY_NONE), memory(m.b, engine, DNNL_MEMORY_NONE),
                 memory(m.c, engine, DNNL_MEMORY_NONE), memory(m.scratchpad, engine, DNNL_MEMORY_NONE)};
  return mine.emplace(s, std::move(t)).first->second;
}

// C (+)= alpha op(A) op(B) on the calling thread; C is bfloat16 or float32 as `c_bfloat16` says.
// Returns oneDNN's status (an exception cannot leave our parallel regions).
dnnl_status_t matmul_on_this_thread(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A,
                                    GemmInput<bfloat16> B, void* C, std::int64_t ldc, bool c_bfloat16, bool accumulate,
                                    float alpha) {
  try {
    ThreadMatmul& m =
        thread_matmul({M, N, K, A.ld, B.ld, ldc, A.transposed, B.transposed, c_bfloat16, accumulate, alpha});
    thread_local dnnl::stream stream(cpu_engine());
    thread_local std::vector<std::byte> scratch;
    if (scratch.size() < m.held.scratchpad.get_size()) scratch.resize(m.held.scratchpad.get_size());
    m.a.set_data_handle(const_cast<bfloat16*>(A.data));
    m.b.set_data_handle(const_cast<bfloat16*>(B.data));
    m.c.set_data_handle(C);
    m.scratchpad.set_data_handle(scratch.data());
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, m.a.get()},
                                    {DNNL_ARG_WEIGHTS, m.b.get()},
                                    {DNNL_ARG_DST, m.c.get()},
                                    {DNNL_ARG_SCRATCHPAD, m.scratchpad.get()}};
    return dnnl_primitive_execute(m.held.primitive.get(), stream.get(), 4, args);
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

// ---- the path, chosen once per process (bf16_path.hpp) ----

// The name oneDNN gives its bf16 matmul here (for a 256^3 product): "brg:avx512_core_amx_bf16" on AMX,
// "brg:avx512_core_bf16" with AVX512-BF16; "none" where it has none.
std::string onednn_matmul_name() {
  const memory::desc square({256, 256}, memory::data_type::bf16, memory::dims{256, 1});
  try {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(square, square, square), cpu_engine()).impl_info_str();
  } catch (const dnnl::error&) {
    return "none";
  }
}

// One product of a fused kernel's tiles, as it calls gemm_tile.
struct TileProduct {
  std::int64_t M, N, K;
  GemmInput<bfloat16> A, B;
  GemmOutput<float> C;
  float alpha;
};

// The operands of the forward's two tile products (flash_forward.cpp) for head width d, at the kernel's
// own sizes and row strides: S = scale Q K^T [rows, kBlockK] (K = d, overwritten) and
// acc += P V [rows, d] (K = kBlockK, accumulated), rows = query_block_rows(); the backward's products
// have the same sizes.
struct TileOperands {
  std::int64_t d, rows = query_block_rows();
  // Aligned to 64 bytes as the kernel's tiles and copies are (hwy's allocator): from malloc these sizes start
  // 16 bytes past a line, and with AMX the logits product then ran 1.7x slower (docs/PERFORMANCE.md, issue 32).
  // q: [rows, d], k: [kBlockK, d], p: [rows, kBlockK], v: [kBlockK, d]; s: [rows, kBlockK], acc: [rows, d].
  hwy::AlignedFreeUniquePtr<bfloat16[]> q, k, p, v;
  hwy::AlignedFreeUniquePtr<float[]> s, acc;

  explicit TileOperands(std::int64_t width) : d(width) {
    using flash::kBlockK;
    // Values in [-1, 1) on a 1/8 grid: finite products, none subnormal, sums far from overflow.
    auto grid = [](std::int64_t size) {
      auto x = hwy::AllocateAligned<bfloat16>(static_cast<std::size_t>(size));
      if (!x) throw std::bad_alloc();
      for (std::int64_t i = 0; i < size; ++i) x[i] = bfloat16(static_cast<float>((i * 37) % 16 - 8) / 8.0f);
      return x;
    };
    auto zeros = [](std::int64_t size) {
      auto x = hwy::AllocateAligned<float>(static_cast<std::size_t>(size));
      if (!x) throw std::bad_alloc();
      std::fill(x.get(), x.get() + size, 0.0f);
      return x;
    };
    q = grid(rows * d), k = grid(kBlockK * d), p = grid(rows * kBlockK), v = grid(kBlockK * d);
    s = zeros(rows * kBlockK), acc = zeros(rows * d);
  }

  std::vector<TileProduct> products() {
    using flash::kBlockK;
    return {{rows, kBlockK, d, plain(q.get(), d), transposed(k.get(), d), overwrite(s.get(), kBlockK), 0.125f},
            {rows, d, kBlockK, plain(p.get(), kBlockK), plain(v.get(), d), accumulate_into(acc.get(), d), 1.0f}};
  }
};

// Seconds for running every product once on `path`; -1 if oneDNN refused one.
double time_products(Bf16Path path, const std::vector<TileProduct>& products) {
  const auto start = std::chrono::steady_clock::now();
  for (const TileProduct& t : products) {
    if (path == Bf16Path::WidenedSgemm) {
      widened_tile(t.M, t.N, t.K, t.A, t.B, t.C, t.alpha);
    } else if (matmul_on_this_thread(t.M, t.N, t.K, t.A, t.B, t.C.data, t.C.ld, false, t.C.accumulate, t.alpha) !=
               dnnl_success) {
      return -1;
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> x) {
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2), x.end());
  return x[x.size() / 2];
}

// Rounds of the measurement: each runs the four tile products (d = 64 and 128) once on each path, the two
// paths alternating so that a change in the machine's load falls on both; the median round counts. About
// 25 MFLOP a round: 7 rounds take 1-3 ms of one core per path (0.4 ms with AMX). kWarmUpRounds before
// them, not counted, make what the products need and a process makes anyway (the four primitives, as the
// kernels' tiles of d = 64 and 128 need them; oneDNN's sgemm kernels, which every product below
// kMinMatmulWork runs on: measured on an Intel Xeon with AMX, 2.5 ms and 34 ms) and warm the caches. And
// the measuring thread's heap: oneDNN's sgemm allocates its packing buffers on every call, and on a thread
// that has not run it before the first ~10 calls of a shape each got fresh pages (14-15 page faults, at
// 10-15 us each on these VMs: the 128 x 256 x 64 logits tile took 165-220 us instead of 22). With one
// warm-up round the measurement read sgemm at 46-62 GFLOP/s on a Zen 5 where the kernels' tiles run at
// 175-195, and could have kept oneDNN where sgemm is faster (bf16_path.hpp). 12 rounds cost 2-6 ms once.
constexpr int kMeasuredRounds = 7;
constexpr int kWarmUpRounds = 12;

// Both paths' GFLOP/s on the tiles, on the calling thread; nullopt if oneDNN refused a product.
std::optional<Bf16PathRates> measure_tile_rates() {
  TileOperands narrow(64), wide(128);
  std::vector<TileProduct> products = narrow.products();
  for (const TileProduct& t : wide.products()) products.push_back(t);
  double flops = 0;
  for (const TileProduct& t : products) flops += 2.0 * static_cast<double>(t.M * t.N * t.K);
  std::vector<double> onednn_s, sgemm_s;
  for (int round = -kWarmUpRounds; round < kMeasuredRounds; ++round) {  // rounds < 0 warm up
    const double onednn = time_products(Bf16Path::OneDnnMatmul, products);
    const double sgemm = time_products(Bf16Path::WidenedSgemm, products);
    if (onednn < 0) return std::nullopt;
    if (round < 0) continue;
    onednn_s.push_back(onednn), sgemm_s.push_back(sgemm);
  }
  return Bf16PathRates{flops / median(onednn_s) * 1e-9, flops / median(sgemm_s) * 1e-9};
}

// The measurement on a thread of its own, with one OpenMP thread allowed there (sgemm then runs on it
// alone), so that it neither reads nor changes the caller's thread count, inside a parallel region or
// not; the caller waits. nullopt if the measurement failed.
std::optional<Bf16PathRates> measure_bf16_paths() {
  std::optional<Bf16PathRates> rates;
  try {
    std::thread([&rates] {
      omp_set_num_threads(1);
      try {
        rates = measure_tile_rates();
      } catch (...) {  // no memory for the operands, or a primitive oneDNN could not make: not measured
      }
    }).join();
  } catch (const std::system_error&) {  // no thread to measure on
  }
  return rates;
}

// The path of this process, decided at its first bfloat16 product that is not small: from
// MHA_BF16_GEMM, or measured (kMeasuredRounds). An invalid MHA_BF16_GEMM is said once on stderr (it cannot
// throw: the first product may run inside a kernel's parallel region) and ignored.
const Bf16PathChoice& bf16_path_choice() {
  static const Bf16PathChoice choice = [] {
    Bf16PathFacts facts{native_bfloat16(), onednn_matmul_name(), std::nullopt, std::nullopt};
    if (const char* value = std::getenv(kBf16PathVariable)) facts.request = value;
    if (parse_bf16_path_request(facts.request) == Bf16PathRequest::Invalid)
      std::fprintf(stderr, "mha: %s=\"%s\" is not onednn, sgemm or auto: ignored (auto, measured)\n", kBf16PathVariable,
                   facts.request->c_str());
    if (bf16_path_needs_rates(facts.onednn_native, facts.request)) facts.rates = measure_bf16_paths();
    return choose_bf16_path(facts);
  }();
  return choice;
}

// Whether a product runs on sgemm over widened operands: small ones always, others where the process's
// path is sgemm (always so without bf16 instructions).
bool runs_widened(std::int64_t M, std::int64_t N, std::int64_t K) {
  return small_product(M, N, K) || bf16_path_choice().path == Bf16Path::WidenedSgemm;
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
  if (runs_widened(M, N, K)) return gemm_widened(M, N, K, A, B, C, alpha);
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

// ---- a tile's transposed first operand, made plain where oneDNN runs on AMX ----

// Whether oneDNN's bf16 matmul here is its AMX kernel. There a tile product whose first operand is transposed
// runs 1.5-2.4x slower than on the same operand stored plain (one thread, the backward's dV += P^T dO at
// 256 x 64 x 256: 18.8 us against 7.8 us; d 128: 24.9 against 16.3; docs/PERFORMANCE.md, issue 32), more
// than transposing it first costs (4.8 us for 256 x 256, bf16_transpose.hpp). With AVX512-BF16 alone
// (brg:avx512_core_bf16) the transposed operand was about 12% slower, and transposing it changed the
// backward's time by less than the machine's noise: there operands are passed as they are.
bool matmul_on_amx() {
  static const bool amx = onednn_matmul_name().find("amx") != std::string::npos;
  return amx;
}

// A (stored [K, M], row stride A.ld, read transposed) copied plain into this thread's scratch
// [M, transposed_row_stride(K)], aligned (hwy's allocator); A itself where the scratch cannot be had (the product
// then reads it transposed, as elsewhere).
GemmInput<bfloat16> plain_copy(std::int64_t M, std::int64_t K, GemmInput<bfloat16> A) {
  thread_local hwy::AlignedFreeUniquePtr<bfloat16[]> scratch;
  thread_local std::int64_t capacity = 0;  // elements
  const std::int64_t ld = transposed_row_stride(K), size = M * ld;
  if (size > capacity) {
    scratch = hwy::AllocateAligned<bfloat16>(static_cast<std::size_t>(size));
    capacity = scratch ? size : 0;
    if (!scratch) return A;
  }
  transpose_bf16(A.data, A.ld, K, M, scratch.get(), ld);
  return plain(static_cast<const bfloat16*>(scratch.get()), ld);
}

void gemm_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
               GemmOutput<float> C, float alpha) {
  if (M == 0 || N == 0) return;
  if (K == 0) return zero_unless_accumulating(M, N, C);
  if (runs_widened(M, N, K)) return widened_tile(M, N, K, A, B, C, alpha);
  if (A.transposed && matmul_on_amx()) A = plain_copy(M, K, A);
  const dnnl_status_t status = matmul_on_this_thread(M, N, K, A, B, C.data, C.ld, false, C.accumulate, alpha);
  if (status == dnnl_success) return;
  // As gemm_tile for float32: a refused tile is a broken internal invariant; stop loudly.
  std::fprintf(stderr, "mha: %s\n", describe_failure(status, M, N, K, A, B, C.ld).c_str());
  std::abort();
}

bool gemm_tile_copies_transposed_bf16() { return matmul_on_amx(); }

Bf16Path bf16_gemm_path() { return bf16_path_choice().path; }

std::string bf16_gemm_implementation() { return bf16_path_choice().description; }

}  // namespace mha::detail
