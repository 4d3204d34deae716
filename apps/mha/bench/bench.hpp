// `mha bench`: our attention core and layer beside the oneDNN sgemm roof and PyTorch 1.13, in one run
// (docs/DESIGN.md section 5; results and analysis in docs/PERFORMANCE.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha_cli {

struct BenchOptions {
  std::string out_dir = "bench-results";  // bench.json and bench.png
  std::vector<int> threads = {1, 2};
  std::vector<std::int64_t> sizes = {512, 2048, 4096, 16384};  // N = L = S
  std::int64_t big = 65536;                                    // N of the forward-only run of ours alone; 0: none
  bool torch = true;                                           // false: no PyTorch runs
  bool quick = false;       // sizes 512, 2048 only, no big size, no grid: a smoke run
  bool grid = true;         // the grid of small and mid shapes (bench_grid.hpp), after the rest
  bool grid_only = false;   // the grid alone
  std::string grid_shapes;  // "B:N:E[:h],..." (bench_grid.hpp's parse_grid_shapes); empty: the default grid
  std::string python = "/usr/bin/python3";  // Debian's, with python3-torch
  std::string torch_script;                 // default: apps/mha/bench/torch_mha.py of the source tree
  // "onednn": PyTorch's sgemm_ calls go to oneDNN (LD_PRELOAD of libmha_onednn_blas.so, built beside
  // this program); "installed": the BLAS Debian's libblas.so.3 points to (netlib's reference BLAS
  // unless OpenBLAS or BLIS is installed); "openblas": Debian's libopenblas0-pthread, through
  // LD_LIBRARY_PATH on its directory. The others are also measured at N = 4096 (when present).
  std::string torch_blas = "onednn";
  double torch_memory_limit_gib = 16;  // PyTorch runs estimated to need more are skipped
  double torch_timeout_s = 900;        // per PyTorch process
  std::string dtype = "float32";       // "bf16": the bfloat16 benchmark instead (bench_bf16.hpp)
  // --decode: the decode benchmark instead (bench_decode.hpp): h 32, h_kv 8 (or --kv-heads), d 128, one query
  // per sequence.
  bool decode = false;
  std::vector<std::int64_t> decode_contexts = {1024, 4096, 16384, 32768, 131072};  // tokens per sequence
  std::vector<std::int64_t> decode_batches = {1, 8};                               // sequences per step
  double decode_max_cache_gib = 8;     // caches (float32 or bf16) larger than this are skipped
  std::int64_t decode_page_size = 16;  // tokens per page
  std::int64_t decode_kv_heads = 8;    // h_kv (h stays 32); the issues' targets are judged at 8 only
  std::int64_t bandwidth_mib = 0;      // the read-bandwidth buffer; 0: 8 x the last-level cache
  // The last-level cache size that decides which caches count as "over the last-level cache" (the
  // targets' rows, the * flag, the default bandwidth buffer); 0: read from sysfs. Tests set it so that
  // their verdicts do not depend on the machine's cache (32 MiB on some machines drawn, 480 on others).
  std::int64_t llc_mib = 0;
  // --variants: issue 31's variants benchmark instead (bench_variants.hpp): packed against padded, sinks,
  // the layer's rotary embedding, each beside the call without it.
  bool variants = false;
  std::int64_t variants_n = 4096;        // N of the sinks and rotary rows; the packed lengths' upper end
  std::int64_t variants_sequences = 16;  // n, the sequences of the packed batch
  int variants_repeats = 0;              // timed calls per figure after a warm-up; 0: 7 (3 for calls over 1 s)
  // --torch-sdpa: issue 34's benchmark instead (bench_torch_sdpa.hpp): mha.torch.scaled_dot_product_attention
  // against torch's own softmax(q k^T + mask) v; uses threads, sizes, variants_repeats (0: 3) and the torch options.
  bool torch_sdpa = false;
};

// Runs the benchmark, printing tables to stdout as it goes; writes out_dir/bench.json and
// out_dir/bench.png. `command` is recorded in bench.json. Returns 0, or throws on failure to run.
int run_bench(const BenchOptions& options, const std::string& command);

}  // namespace mha_cli
