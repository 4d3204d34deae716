// How `mha bench` times a call and measures the roof and the memory (docs/DESIGN.md section 5).
#pragma once

#include <cstdint>
#include <functional>

#include "attention/flash_config.hpp"  // the fused kernel's tile sizes, which kTile* and tile_rows() mirror
#include "attention/query_block.hpp"

namespace mha_cli::bench {

// How many times a call is repeated. One warm-up call (first-touch page faults, oneDNN's JIT), then
// timed calls until at least min_reps calls and min_time_s seconds, stopping early (after at least
// one) once max_time_s is passed. A warm-up call longer than max_time_s is taken as the one timed
// call: first-call costs are milliseconds, under 1% of such a call.
struct RepeatPolicy {
  int warmup = 1;
  int min_reps = 3;
  int max_reps = 100;
  double min_time_s = 1.0;
  double max_time_s = 8.0;
};

struct Timing {
  double min_s = 0;     // the reported figure, the best call: other work on a shared machine only ever
                        // slows a call down, so the fastest call is the closest to the kernel's own speed
  double median_s = 0;  // kept in bench.json: how much the calls varied
  int reps = 0;
};

Timing measure(const std::function<void()>& call, const RepeatPolicy& policy);

// The roof: the best GFLOP/s of oneDNN's sgemm C [2048, 2048] = A [2048, 2048] B [2048, 2048] with the
// current OpenMP thread count (set by mha::set_num_threads).
struct Roof {
  int threads = 0;
  double gflops = 0;
  Timing timing;
  double spread = 1;  // for a group's roof (bench.cpp's GroupRoof): the better of the before and after
                      // measurements over the worse; 1 for a single measurement
};
inline constexpr std::int64_t kRoofSize = 2048;
Roof measure_roof(int threads);

// The rate of the products inside the fused kernel's forward, alone: one thread streams kTileKeys
// keys past one block of tile_rows() queries, computing S = Q K_blk^T [tile_rows(), kTileKeys] (K = d = 64)
// and acc += S V_blk [tile_rows(), 64] (K = kTileKeys) through dnnl_sgemm, as FlashForward does, without the softmax
// between them. The attention core cannot run faster than this; the gap between this and the roof
// is what small-tile products cost. The tile sizes mirror src/attention/flash_config.hpp.
struct TileRate {
  double gflops = 0;
  Timing timing;
};
inline std::int64_t tile_rows() { return mha::detail::query_block_rows(); }  // this process's query block
inline constexpr std::int64_t kTileKeys = mha::detail::flash::kBlockK;
inline constexpr std::int64_t kTileWidth = 64;  // d
TileRate measure_tile_sgemm();

// Peak resident set of this process so far, in bytes: VmHWM of /proc/self/status (getrusage's
// ru_maxrss where /proc is missing). Not ru_maxrss first: Linux carries it over fork and execve, so
// a child of a large process (`mha bench`, ~100 MiB with its roof matrices) starts with its parent's
// resident set as its "peak". VmHWM belongs to the address space, which execve replaces.
std::int64_t peak_rss_bytes();

}  // namespace mha_cli::bench
