// Decode over int8 pages on AMX tiles (Intel's Advanced Matrix Extensions: TDPBSSD, TDPBUSD), exact
// integer products in place of the widening FMAs of decode_rows-inl.h.
//
// Why: a decode step reads the cache once, and int8 rows are a quarter of float32's bytes, but widening
// each byte (sign-extend, convert) and multiplying it by g query rows costs more instructions per byte
// than the read itself. On the model-167 Xeon (docs/PERFORMANCE.md, issue 33) the tiles compute a step
// 1.2-1.4x faster than the vectors from the L2 and L3, and 1.08-1.10x faster from memory (0.55-0.57 of
// one core's read bandwidth against 0.50-0.53, 8 x 128k positions).
//
// How, without changing what is computed (attention over the dequantized cache, float32 results):
//   logits: a query row q (float32) becomes an integer q_i = q 2^(30-e) rounded (2^e > max|q|, so
//     |q_i| < 2^30, error <= 2^-31 max|q| per element) written as four signed base-256 digits,
//     q_i = sum_k 256^k d_k with d_k in [-128, 127]. TDPBSSD multiplies 16 key rows [16, 64 bytes] by the
//     digits of 4 query rows (16 columns: digit k of row r in column 4k + r) into exact int32 sums
//     (|sum| <= d_k * 127 * 128: converted to float32 exactly up to d_k = 1024, with one rounding
//     beyond), combined: dot = ((c0 + 2^16 c2) + 2^8 (c1 + 2^16 c3)) 2^(e-30), each step one rounding.
//   P V: a row's weights p (already times each value row's scale, >= 0) become p_i = p 2^(31-e) rounded
//     (2^e > max p, so p_i < 2^31, error <= 2^-32 max p) as four unsigned digits; TDPBUSD multiplies the
//     digits of 4 rows [16, 64 keys] by the block's 64 value rows laid out four keys per 32-bit column
//     (the tiles' pairing), 16 value columns at a time (|sum| <= 64 * 255 * 127 < 2^21: exact), and the
//     sums combine as above.
// So each logit and each acc update is the exact product of slightly rounded operands (relative error
// ~2^-31 per element), then a few float32 roundings: within the float32 rule, not bitwise the vector
// kernel's. A row is computed alone in every step (its own digits, its own scale, columns of its own),
// so packed and per-head items still agree bitwise.
//
// Calls with one query row per kv head run on the vectors (kMinGroupRows). A row the tiles cannot
// represent goes through the vector kernel instead: a query row not finite or with max|q| outside
// [2^-60, 2^60]; in a block, weights not finite or with max p outside [2^-60, 2^60] (e.g. a value row's
// NaN scale, or subnormal scales). d_k and d_v must be multiples of 16.
//
// MHA_DECODE_AMX=off forces the vector kernel (for tests and measurements); "on" or unset uses the tiles
// where the CPU has AMX-INT8 and the OS grants the tile state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mha::detail::amx {

inline constexpr const char* kDecodeAmxVariable = "MHA_DECODE_AMX";

// What the choice is made from.
struct TileFacts {
  bool cpu_has_amx_int8 = false;       // CPUID: AMX-TILE, AMX-INT8 and AVX-512 F/BW/VL/DQ
  bool os_grants_tiles = false;        // XCR0 enables the tile state and the kernel granted it to this process
  std::optional<std::string> request;  // MHA_DECODE_AMX's value; nullopt when unset or empty
};

struct TileChoice {
  bool tiles;               // int8 decode on AMX tiles
  std::string description;  // e.g. "AMX tiles (the CPU has AMX-INT8)", "vectors (forced by MHA_DECODE_AMX=off)"
};

// The decision from the facts alone (tests fake them): tiles where both facts hold, unless "off" is
// requested. "on" where they do not hold falls back to vectors and says so; other values are ignored.
TileChoice choose_int8_tiles(const TileFacts& facts);

// This process's choice, decided at the first call (thread-safe): reads CPUID and the environment and,
// where the CPU has AMX-INT8, asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
const TileChoice& int8_tiles();

// The fewest query rows per kv head's group (g x Lq: its query heads times the new queries) that the tiles
// take. A tile product computes four rows at a time; with one row (h = h_kv and one new query: attention as
// in the original Transformer) three quarters of each product is zeros, and the tiles lost to the vectors
// on the model-167 Xeon (h = h_kv = 32, d 128, 2 x 128k int8 positions, one thread: 199-202 against 184-187
// ms; 3% slower from the L2), while two rows already won (h_kv = 16: 106 against 127-130 ms).
// docs/PERFORMANCE.md, issue 33.
inline constexpr std::int64_t kMinGroupRows = 2;

// Whether the tiles take a call of these head widths and query rows per kv head's group.
inline bool takes(std::int64_t d_k, std::int64_t d_v, std::int64_t group_rows) {
  return d_k % 16 == 0 && d_v % 16 == 0 && d_k > 0 && d_v > 0 && group_rows >= kMinGroupRows;
}

inline constexpr int kGroupRows = 4;   // query rows (or weight rows) per tile product: 4 digits x 4 rows
inline constexpr int kTileKeys = 16;   // keys per logits tile
inline constexpr int kBlockKeys = 64;  // keys per P V product (decode's kKeyBlock)

// A group of up to 4 rows in tile form: which rows the tiles compute (bit r) and the power of two that
// turns row r's integer sums back into its values.
struct RowGroup {
  float unscale[kGroupRows];
  unsigned tiled;
};

// The lines of the block read next (its key rows and value rows), prefetched a share at a time at points
// spread over a block's work: the core keeps computing while they arrive. A core has few line fill
// buffers (16 here), and a prefetch waits for a free one: issued in one burst (256 prefetches a block at
// d = 128), they stall the core until most lines have arrived, and the step takes the read plus the
// compute; spread over the products, the value layout and the sums, the two overlap.
class LinesAhead {
 public:
  LinesAhead() = default;
  LinesAhead(const std::int8_t* const* keys, const std::int8_t* const* values, std::int64_t rows,
             std::int64_t key_bytes, std::int64_t value_bytes, bool into_l2)
      : keys_(keys),
        values_(values),
        rows_(rows),
        key_bytes_(key_bytes),
        value_bytes_(value_bytes),
        into_l2_(into_l2) {}

  // Prefetches rows (each key row's lines, then its value row's) until `share` (0..1) of the block's
  // rows have been asked for; share 1 asks for all that remain.
  void issue_until(double share) {
    const auto goal = share >= 1.0 ? rows_ : static_cast<std::int64_t>(share * static_cast<double>(rows_));
    for (; issued_ < goal; ++issued_) {
      prefetch(keys_[issued_], key_bytes_);
      prefetch(values_[issued_], value_bytes_);
    }
  }

 private:
  void prefetch(const std::int8_t* row, std::int64_t bytes) const {
    const auto start = reinterpret_cast<std::uintptr_t>(row), end = start + static_cast<std::uintptr_t>(bytes);
    for (std::uintptr_t line = start & ~std::uintptr_t{63}; line < end; line += 64)
      if (into_l2_) __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 1);
      else __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
  }

  const std::int8_t* const* keys_ = nullptr;
  const std::int8_t* const* values_ = nullptr;
  std::int64_t rows_ = 0, key_bytes_ = 0, value_bytes_ = 0, issued_ = 0;
  bool into_l2_ = false;
};

// One thread's scratch for items of `kv_heads` x `rows_per_head` rows, as the bytes to allocate (64-byte
// aligned) and the views into them.
std::int64_t scratch_bytes(std::int64_t kv_heads, std::int64_t rows_per_head, std::int64_t d_k, std::int64_t d_v);
struct Scratch {
  std::int8_t* query_digits;  // [groups][d_k / 4][64]: each group's digits as TDPBSSD's second operand
  RowGroup* query_groups;     // [groups]
  std::int8_t* keys;          // [4][16, d_k]: key tiles gathered where their rows are not back to back
  std::int32_t* sums;         // [4][16][16]: four products' int32 sums
  std::uint8_t* weights;      // [16][64]: a group's weight digits, row 4 k + r digit k of row r
  std::int8_t* values;  // [d_v / 16 rounded up to 4][16][64]: a block's value rows, four keys per word; zeros past d_v
};
Scratch carve_scratch(void* base, std::int64_t kv_heads, std::int64_t rows_per_head, std::int64_t d_k,
                      std::int64_t d_v);

// The calling thread's tile registers shaped for heads of d_k (ldtilecfg), released at destruction
// (tilerelease). Every function below runs between the two, on the thread that made it.
class TileConfig {
 public:
  explicit TileConfig(std::int64_t d_k);
  ~TileConfig();
  TileConfig(const TileConfig&) = delete;
  TileConfig& operator=(const TileConfig&) = delete;
};

// The digits of query rows q [rows, ld_q] (rows <= 4, d_k columns) into digits [d_k / 4][64]; returns
// the group's scales and which rows are tiled (the others' digits are 0).
RowGroup query_digits(const float* q, std::int64_t ld_q, int rows, std::int64_t d_k, std::int8_t* digits);

// dots [rows, ld_dots] columns 0..63 = the group's query rows . the block's key rows, four tiles of 16:
// key 16 t + j at keys[t] + j stride (d_k bytes each), for the tiled rows (the others get 0).
// Meanwhile, ahead (unless nullptr) is issued up to 8% of its lines per key tile (32% in all).
void key_block_dots(const std::int8_t* const* keys, std::int64_t stride, std::int64_t d_k, const std::int8_t* digits,
                    const RowGroup& group, int rows, float* dots, std::int64_t ld_dots, std::int32_t* sums,
                    LinesAhead* ahead);

// The rows k_rows[0 .. n) (n <= 16) of d_k bytes into tile [16, d_k], zeros past n.
void gather_key_tile(const std::int8_t* const* k_rows, std::int64_t n, std::int64_t d_k, std::int8_t* tile);

// A block's value rows v_rows[0 .. kb) (kb <= 64, zeros past kb) into values [d_v / 16][16][64]: chunk c,
// row j4, bytes 4 n + i = value row 4 j4 + i, column 16 c + n. Meanwhile, ahead is issued from `from`
// to `to` of its lines, evenly over the 16 groups of 4 keys.
void value_tiles(const std::int8_t* const* v_rows, std::int64_t kb, std::int64_t d_v, std::int8_t* values,
                 LinesAhead& ahead, double from, double to);

// The digits of weight rows p [rows, ld_p] (rows <= 4, 64 keys, each >= 0 or NaN) into weights [16][64];
// returns the group's scales and which rows are tiled (a row of zeros is, and adds nothing).
RowGroup weight_digits(const float* p, std::int64_t ld_p, int rows, std::uint8_t* weights);

// acc [rows, ld_acc] += P V for the tiled rows of the group, over the block's value tiles. Meanwhile,
// ahead is issued from `from` to `to` of its lines, evenly over the chunks.
void accumulate_values(const std::uint8_t* weights, const RowGroup& group, int rows, const std::int8_t* values,
                       std::int64_t d_v, float* acc, std::int64_t ld_acc, std::int32_t* sums, LinesAhead& ahead,
                       double from, double to);

}  // namespace mha::detail::amx
