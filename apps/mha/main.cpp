// The `mha` command: multi-head attention (Vaswani et al. 2017, section 3.2) from the shell.
//
// Exit status: 0 success; 1 an error while running (printed as "mha: error: <message>"), including
// `mha heads` whose heads fail their check and output that could not be written (a full disk, a closed
// standard output: whatever the command's status would have been); 2 a command-line misuse (CLI11's
// message).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "bench/bench.hpp"
#include "bench/bench_bf16.hpp"
#include "bench/bench_decode.hpp"
#include "bench/bench_grid.hpp"
#include "bench/bench_one.hpp"
#include "bench/bench_torch_sdpa.hpp"
#include "bench/bench_variants.hpp"
#include "commands/demo.hpp"
#include "commands/heads.hpp"
#ifdef MHA_HAVE_DISTRIBUTED
#include "distributed/bench_ring.hpp"
#include "distributed/ring_check.hpp"
#endif
#include "commands/heads_model.hpp"
#include "commands/run.hpp"
#include "commands/translate.hpp"
#include "explore/explore.hpp"
#include "mha/attention.hpp"
#include "mha/error.hpp"
#include "number_options.hpp"
#include "render/terminal_text.hpp"
#include "transformer/dates.hpp"
#include "unknown_command.hpp"

namespace {

using mha_cli::integer_in;
using mha_cli::number_in;
using mha_cli::unsigned_integer;

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr std::int64_t kMaxBenchN = 1 << 22;   // --sizes, --big, --n: far past what fits in memory here
constexpr std::int64_t kMaxHeads = 65536;      // --heads of `mha run` and `mha bench-one`
constexpr std::int64_t kMaxWidth = 65536;      // bench-one's --d-model and --batch
constexpr std::int64_t kMaxReps = 1'000'000;   // bench-one's --min-reps, --max-reps
constexpr double kMaxSeconds = 7 * 24 * 3600;  // time limits: a week
constexpr std::int64_t kMaxBeams = 64;         // --beam(s): the vocabulary has 71 tokens; each beam is a decoder row

// The --threads options: 0 (where offered) leaves OpenMP's default; the top is the library's bound
// (mha::max_num_threads(), which depends on the machine's cores).
CLI::Option* threads_option(CLI::Option* option, std::int64_t lowest) {
  return integer_in(option, lowest, mha::max_num_threads());
}

void add_demo_command(CLI::App& app, mha_cli::DemoOptions& o) {
  CLI::App* demo = app.add_subcommand(
      "demo",
      "The main job: train the paper's Transformer to normalise dates (~2 min), report accuracy and attention maps");
  demo->add_option("--out", o.out_dir, "Report folder: index.html, maps, learning curve, checkpoint.safetensors")
      ->capture_default_str();
  integer_in(demo->add_option("--steps", o.steps, "Training steps"), 1, 10'000'000)->capture_default_str();
  integer_in(demo->add_option("--batch", o.batch_size, "Examples per step"), 1, 65536)->capture_default_str();
  integer_in(demo->add_option("--heads", o.heads, "Attention heads h (d_k = d_v = d_model / h)"), 1, 1024)
      ->capture_default_str();
  integer_in(demo->add_option("--d-model", o.d_model, "Model width d_model"), 1, 8192)->capture_default_str();
  integer_in(demo->add_option("--d-ff", o.d_ff, "Feed-forward inner width d_ff"), 1, 65536)->capture_default_str();
  integer_in(demo->add_option("--layers", o.layers, "Encoder layers and decoder layers (N each)"), 1, 64)
      ->capture_default_str();
  demo->add_flag("--pre-norm", o.pre_norm,
                 "Layer normalisation before each sub-layer (default: after, as in the paper)");
  number_in(demo->add_option("--dropout", o.dropout, "Residual dropout P_drop"), 0.0, 0.99)->capture_default_str();
  number_in(demo->add_option("--attention-dropout", o.attention_dropout, "Dropout on the attention weights"), 0.0, 0.99)
      ->capture_default_str();
  number_in(demo->add_option("--label-smoothing", o.label_smoothing, "Label smoothing epsilon"), 0.0, 0.99)
      ->capture_default_str();
  integer_in(demo->add_option("--warmup", o.warmup, "Warm-up steps of the learning-rate schedule"), 1, 10'000'000)
      ->capture_default_str();
  number_in(demo->add_option("--lr-factor", o.lr_factor,
                             "Factor of the schedule d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)"),
            1e-6, 1e3)
      ->capture_default_str();
  unsigned_integer(demo->add_option("--seed", o.seed, "Seed of the initialisation, the data and dropout"))
      ->capture_default_str();
  integer_in(demo->add_option("--eval", o.eval_examples, "Held-out examples of the final accuracy"), 1, 1'000'000)
      ->capture_default_str();
  integer_in(demo->add_option("--eval-every", o.eval_every, "Steps between the learning curve's accuracy points"), 1,
             10'000'000)
      ->capture_default_str();
  integer_in(demo->add_option("--maps", o.map_examples, "Held-out examples drawn as attention maps"), 0, 6)
      ->capture_default_str();
  demo->add_option("--dtype", o.dtype,
                   "float32: train in float32; bf16: bfloat16 mixed precision (bf16 products with float32 "
                   "accumulation, float32 master weights in Adam, float32 layer norm and loss), after a float32 run "
                   "of the same settings and seed, so that the report shows both training times side by side (the "
                   "command takes about twice as long); the checkpoint holds the float32 master weights")
      ->check(CLI::IsMember({"float32", "bf16"}))
      ->capture_default_str();
  integer_in(demo->add_option("--beams", o.beams,
                              "Beam widths whose held-out accuracy and decode time are reported beside greedy's")
                 ->delimiter(','),
             1, kMaxBeams)
      ->capture_default_str();
  threads_option(demo->add_option("--threads", o.threads, "Threads (0: OpenMP's default)"), 0)->capture_default_str();
  demo->add_flag("!--no-progress", o.progress, "No progress bar");
}

// What `mha translate --help` says: the formats the model was trained on, with 5 March 2021 in each, the
// years it knows, and what its output lines and exit statuses mean.
std::string translate_description() {
  std::string text =
      "Rewrite dates as ISO 8601 with the model `mha demo` trained, e.g. mha translate \"Fri, 5 Mar 21\"\n"
      "Trained formats (5 March 2021 in each; numeric dates are day-first unless the year comes first):\n";
  for (const transformer::DateFormat f : transformer::all_date_formats())
    text += fmt::format("  {:<24} {}\n", transformer::format_date({2021, 3, 5}, f), transformer::format_description(f));
  return text +
         fmt::format(
             "Years {}-{} (two-digit years: 50-99 are 19xx, 00-49 are 20xx). Inputs are read as the formats write\n"
             "them: surrounding and repeated spaces, trailing periods and commas dropped; month and\n"
             "weekday names in any letter case.\n"
             "Output, one line per input:\n"
             "  YYYY-MM-DD                      the answer, when it passes its checks\n"
             "  ? ANSWER  REASON                not a calendar date, outside those years, or not the\n"
             "                                  year the input states (in four digits, or two), or the\n"
             "                                  decoder less sure of it than of 99% of its correct\n"
             "                                  held-out answers (the checkpoint's unsure_below)\n"
             "  ? not translated: REASON        an input that cannot be read (also on standard error)\n"
             "Exit status: 0 every answer passed, 3 some marked ?, 1 some inputs not translated.",
             transformer::kFirstYear, transformer::kLastYear);
}

void add_translate_command(CLI::App& app, mha_cli::TranslateOptions& o) {
  CLI::App* translate = app.add_subcommand("translate", translate_description());
  translate->add_option("text", o.texts, "Dates to rewrite (none: one per line from standard input)");
  translate->add_option("--checkpoint", o.checkpoint, "The checkpoint `mha demo` wrote")->capture_default_str();
  integer_in(translate->add_option("--beam", o.beams,
                                   "Beams of the beam search (1: greedy decoding; the best-scoring answer is printed)"),
             1, kMaxBeams)
      ->capture_default_str();
  mha_cli::add_kv_cache_option(*translate, o);
  threads_option(translate->add_option("--threads", o.threads, "Threads (0: OpenMP's default)"), 0);
}

void add_explore_command(CLI::App& app, mha_cli::ExploreOptions& o) {
  CLI::App* explore = app.add_subcommand(
      "explore",
      "A local web page on the trained model: type a date, see the translation, its confidence and every head's "
      "attention map; switch heads off and see what changes, held-out accuracy included (Ctrl-C stops)");
  explore->add_option("--checkpoint", o.checkpoint, "The checkpoint `mha demo` wrote")->capture_default_str();
  integer_in(explore->add_option("--port", o.port, "TCP port (0: any free port, printed)"), 0, 65535)
      ->capture_default_str();
  explore
      ->add_option("--host", o.host,
                   "Address to listen on; anything but loopback lets other machines in (a warning is printed)")
      ->capture_default_str();
  threads_option(explore->add_option("--threads", o.threads, "Threads per request (requests run side by side)"), 1)
      ->capture_default_str();
}

void add_heads_command(CLI::App& app, mha_cli::HeadsOptions& options) {
  CLI::App* heads = app.add_subcommand(
      "heads", "Hand-built heads that attend by four rules (previous, next, same symbol, first): scores, check, maps");
  heads->add_option("--out", options.out_dir, "Directory for the attention-map images and index.html")
      ->capture_default_str();
  threads_option(heads->add_option("--threads", options.threads, "Threads for the library's kernels (0: its default)"),
                 0)
      ->capture_default_str();
  heads->add_option("--text", options.text, "The token sequence, one token per character")
      ->check(CLI::Validator([](std::string& text) { return mha_cli::heads::check_text(text); }, ""))
      ->capture_default_str();
}

void add_bench_command(CLI::App& app, mha_cli::BenchOptions& options) {
  CLI::App* bench = app.add_subcommand(
      "bench", "Side-by-side benchmark: oneDNN sgemm roof, our attention core and layer, PyTorch 1.13 (takes minutes)");
  bench->add_option("--out", options.out_dir, "Directory for bench.json and bench.png")->capture_default_str();
  threads_option(bench->add_option("--threads", options.threads, "Thread counts, comma-separated")->delimiter(','), 1)
      ->default_str("1,2");
  CLI::Option* sizes = integer_in(
      bench->add_option("--sizes", options.sizes, "Sequence lengths N = L = S, comma-separated")->delimiter(','), 1,
      kMaxBenchN);
  sizes->default_str("512,2048,4096,16384");
  CLI::Option* big = integer_in(
      bench->add_option("--big", options.big,
                        "N of the long runs of ours alone: forward, and the layer's training step (0: none)"),
      0, kMaxBenchN);
  big->capture_default_str();
  bench->add_flag("!--no-torch", options.torch, "Do not run PyTorch");
  CLI::Option* quick =
      bench->add_flag("--quick", options.quick, "A smoke run: sizes 512,2048 only, no big size, no grid");
  CLI::Option* no_grid = bench->add_flag("!--no-grid", options.grid,
                                         "Skip the grid of small and mid shapes (B 1,8,64 x N 16,64,256,512 x "
                                         "E 64,256,512, h = E/64: ours against PyTorch), which runs last");
  CLI::Option* grid_only = bench->add_flag("--grid-only", options.grid_only,
                                           "Run only the grid of small and mid shapes (a few minutes), nothing else");
  bench
      ->add_option("--grid-shapes", options.grid_shapes,
                   "The grid's shapes instead of the default: B:N:E or B:N:E:h (h = E/64 unless given), "
                   "comma-separated, e.g. 1:64:256,8:512:512")
      ->check(CLI::Validator(
          [](std::string& spec) {
            try {
              mha_cli::bench::parse_grid_shapes(spec);
              return std::string();
            } catch (const std::invalid_argument& e) {
              return std::string(e.what());
            }
          },
          "B:N:E[:h],..."))
      ->excludes(no_grid)
      ->excludes(quick);
  grid_only->excludes(no_grid)->excludes(quick)->excludes(sizes)->excludes(big);
  bench
      ->add_option("--torch-blas", options.torch_blas,
                   "BLAS under PyTorch's products: onednn (its sgemm_ preloaded onto oneDNN), openblas (Debian's "
                   "libopenblas0-pthread) or installed (libblas.so.3); the others are measured once at N 4096")
      ->check(CLI::IsMember({"onednn", "openblas", "installed"}))
      ->capture_default_str();
  bench
      ->add_option("--dtype", options.dtype,
                   "float32: the benchmark above; bf16: bfloat16 instead (oneDNN's bf16 matmul roof, the core at d 64 "
                   "and 128 and the layer against our float32 and PyTorch in bf16 and float32; --sizes default 4096)")
      ->check(CLI::IsMember({"float32", "bf16"}))
      ->capture_default_str();
  bench->add_flag(
      "--decode", options.decode,
      "The decode benchmark instead: a decode step over a paged KV cache (h 32, h_kv 8 or --kv-heads, d 128) against "
      "the machine's read bandwidth, float32, bf16, int8 and float8 e4m3 caches, GQA-packed and per head");
  integer_in(bench->add_option("--contexts", options.decode_contexts, "--decode: tokens per sequence, comma-separated")
                 ->delimiter(','),
             1, kMaxBenchN)
      ->default_str("1024,4096,16384,32768,131072");
  integer_in(bench->add_option("--batches", options.decode_batches, "--decode: sequences per step, comma-separated")
                 ->delimiter(','),
             1, 256)
      ->default_str("1,8");
  number_in(bench->add_option("--max-cache-gib", options.decode_max_cache_gib,
                              "--decode: caches larger than this many GiB are skipped"),
            0.0, 1e6)
      ->capture_default_str();
  integer_in(bench->add_option("--page-size", options.decode_page_size, "--decode: tokens per page"), 1, 65536)
      ->capture_default_str();
  integer_in(bench->add_option("--kv-heads", options.decode_kv_heads,
                               "--decode: key/value heads h_kv, a divisor of h = 32: 32 is plain multi-head "
                               "attention, 1 multi-query; the issues' targets are judged at 8 only"),
             1, 32)
      ->check(CLI::IsMember({1, 2, 4, 8, 16, 32}))
      ->capture_default_str();
  integer_in(bench->add_option("--bandwidth-mib", options.bandwidth_mib,
                               "--decode: MiB read to measure the read bandwidth (0: 8 x the last-level cache)"),
             0, 1 << 20)
      ->capture_default_str();
  integer_in(bench->add_option("--llc-mib", options.llc_mib,
                               "--decode: the last-level cache size in MiB that decides which caches are over it "
                               "(0: this machine's, from sysfs)"),
             0, 1 << 20)
      ->capture_default_str();
  CLI::Option* variants = bench->add_flag(
      "--variants", options.variants,
      "Issue 31's variants benchmark instead: packed (varlen) against padded attention, 16 sequences of skewed "
      "lengths; attention sinks on and off; the layer with rotary_dim 64 against 0; each ratio against its target");
  variants->excludes(bench->get_option("--decode"));
  integer_in(bench->add_option("--variants-n", options.variants_n,
                               "--variants: N of the sinks and rotary rows, and the packed lengths' upper end"),
             16, kMaxBenchN)
      ->capture_default_str();
  integer_in(bench->add_option("--sequences", options.variants_sequences, "--variants: sequences in the packed batch"),
             1, 4096)
      ->capture_default_str();
  integer_in(
      bench->add_option("--repeats", options.variants_repeats,
                        "--variants, --torch-sdpa: timed calls per figure after a warm-up (0: --variants 7, or 3 "
                        "for calls over 1 s; --torch-sdpa 3)"),
      0, 1000)
      ->capture_default_str();
  bench
      ->add_flag("--torch-sdpa", options.torch_sdpa,
                 "Issue 34's benchmark instead: mha.torch.scaled_dot_product_attention against torch's softmax(q k^T + "
                 "mask) v, float32 and bf16, N from --sizes (default 512,1024,2048,4096,8192): speed, peak memory, and "
                 "the per-call overhead over the C++ kernel at [1, 8, 64, 64]")
      ->excludes(bench->get_option("--decode"))
      ->excludes(variants);
  bench->add_option("--python", options.python, "The Python with torch")->capture_default_str();
  bench->add_option("--torch-script", options.torch_script,
                    "PyTorch's side (default: apps/mha/bench/torch_mha.py; --torch-sdpa: torch_sdpa.py)");
  number_in(bench->add_option("--torch-memory-limit", options.torch_memory_limit_gib,
                              "GiB: PyTorch runs estimated to need more are skipped"),
            0.0, 1e6)
      ->capture_default_str();
  number_in(bench->add_option("--torch-timeout", options.torch_timeout_s, "Seconds per PyTorch process"), 1.0,
            kMaxSeconds)
      ->capture_default_str();
}

void add_run_command(CLI::App& app, mha_cli::RunOptions& o) {
  CLI::App* run = app.add_subcommand(
      "run", "Apply a layer stored in safetensors to inputs in .npy files; write the output (and weights) as .npy");
  run->add_option("--weights", o.weights, "safetensors file with the layer's parameters (PyTorch state_dict names)")
      ->required();
  run->add_option("--query", o.query, ".npy query: [B, L, E] batch-first, [L, B, E] seq-first, or [L, E]")->required();
  run->add_option("--key", o.key, ".npy key (default: the query)");
  run->add_option("--value", o.value, ".npy value (default: the key)");
  run->add_option("--key-padding-mask", o.key_padding_mask, ".npy bool [B, S] ([S] unbatched), true = padding");
  run->add_option("--attn-mask", o.attn_mask,
                  ".npy bool (true = may not attend) or float (added), [L, S] or [B*h, L, S]");
  run->add_flag("--causal", o.causal, "Causal mask, bottom-right aligned: query i sees key j <= i + S - L");
  run->add_option("--out", o.out, ".npy file for the output")->required();
  run->add_option("--weights-out", o.weights_out, ".npy file for the attention weights (averaged over heads)");
  run->add_flag("--per-head-weights", o.per_head_weights, "Write the weights per head [B, h, L, S]");
  threads_option(run->add_option("--threads", o.threads, "Threads for the library's kernels (0: its default)"), 0);
  integer_in(
      run->add_option(
          "--heads", o.heads,
          "Number of heads: required for a file without mha's metadata (e.g. from PyTorch), checked against it otherwise"),
      1, kMaxHeads);
  run->add_flag("--add-zero-attn", o.add_zero_attn,
                "The layer has add_zero_attn (files without metadata; checked against it otherwise)");
  run->add_option("--layout", o.layout,
                  "Input layout: required for a file without mha's metadata (PyTorch's state_dict; its default is "
                  "seq-first), checked against the metadata otherwise")
      ->check(CLI::IsMember({"batch-first", "seq-first"}));
}

// `mha bench-one`: what `mha bench` runs in a process of its own; hidden from --help.
void add_bench_one_command(CLI::App& app, mha_cli::BenchOneOptions& options) {
  CLI::App* one = app.add_subcommand("bench-one", "One shape timed in its own process; prints JSON");
  one->group("");
  one->add_option("--impl", options.impl)->check(CLI::IsMember({"mha", "core"}));
  integer_in(one->add_option("--n", options.n), 1, kMaxBenchN);
  one->add_option("--causal", options.causal);
  threads_option(one->add_option("--threads", options.threads), 1);
  one->add_option("--pass", options.pass)->check(CLI::IsMember({"fwd", "fwdbwd"}));
  integer_in(one->add_option("--batch", options.batch), 1, kMaxWidth);
  integer_in(one->add_option("--d-model", options.d_model), 1, kMaxWidth);
  integer_in(one->add_option("--heads", options.heads), 1, kMaxHeads);
  one->add_option("--dtype", options.dtype)->check(CLI::IsMember({"float32", "bf16"}));
  integer_in(one->add_option("--warmup", options.policy.warmup), 0, kMaxReps);
  integer_in(one->add_option("--min-reps", options.policy.min_reps), 1, kMaxReps);
  integer_in(one->add_option("--max-reps", options.policy.max_reps), 1, kMaxReps);
  number_in(one->add_option("--min-time", options.policy.min_time_s), 0.0, kMaxSeconds);
  number_in(one->add_option("--max-time", options.policy.max_time_s), 0.0, kMaxSeconds);
}

// `mha bench-grid`: the grid of small and mid shapes, ours, in one process; hidden from --help.
void add_bench_grid_command(CLI::App& app, mha_cli::BenchGridOptions& options) {
  CLI::App* grid = app.add_subcommand("bench-grid", "The grid's shapes timed in this process; prints JSON lines");
  grid->group("");
  grid->add_option("--shapes", options.shapes)->required();
  threads_option(grid->add_option("--threads", options.threads), 1);
  integer_in(grid->add_option("--warmup", options.policy.warmup), 0, kMaxReps);
  integer_in(grid->add_option("--min-reps", options.policy.min_reps), 1, kMaxReps);
  integer_in(grid->add_option("--max-reps", options.policy.max_reps), 1, kMaxReps);
  number_in(grid->add_option("--min-time", options.policy.min_time_s), 0.0, kMaxSeconds);
  number_in(grid->add_option("--max-time", options.policy.max_time_s), 0.0, kMaxSeconds);
}

#ifdef MHA_HAVE_DISTRIBUTED
void add_ring_commands(CLI::App& app, mha_cli::RingCheckOptions& check, mha_cli::BenchRingOptions& bench) {
  CLI::App* c = app.add_subcommand(
      "ring-check", "Ring attention over MPI checked against one process: mpirun -np P mha ring-check [options]");
  integer_in(c->add_option("--n", check.n, "Sequence length N (queries = keys)"), 1, 1 << 22)->capture_default_str();
  integer_in(c->add_option("--batch", check.batch, "Batch size B"), 1, 1024)->capture_default_str();
  integer_in(c->add_option("--heads", check.heads, "Heads h"), 1, 1024)->capture_default_str();
  integer_in(c->add_option("--dim", check.dim, "Width per head d_k = d_v"), 1, 4096)->capture_default_str();
  c->add_flag("--causal", check.causal, "Causal attention over the whole sequence");
  c->add_option("--layout", check.layout, "How the sequence is cut among ranks")
      ->check(CLI::IsMember({"zigzag", "contiguous"}))
      ->capture_default_str();
  c->add_option("--dtype", check.dtype)->check(CLI::IsMember({"float32", "float64"}))->capture_default_str();
  unsigned_integer(c->add_option("--seed", check.seed, "Seed of the inputs"))->capture_default_str();
  threads_option(c->add_option("--threads", check.threads, "Threads per rank"), 1)->capture_default_str();

  CLI::App* b = app.add_subcommand(
      "bench-ring", "Ring attention on P ranks against one rank, one thread each: mpirun -np P mha bench-ring");
  integer_in(b->add_option("--sizes", bench.sizes, "Sequence lengths N, comma-separated")->delimiter(','), 1, 1 << 22)
      ->default_str("8192,16384");
  integer_in(b->add_option("--heads", bench.heads, "Heads h"), 1, 1024)->capture_default_str();
  integer_in(b->add_option("--dim", bench.dim, "Width per head d_k = d_v"), 1, 4096)->capture_default_str();
  integer_in(b->add_option("--reps", bench.reps, "Timed runs per measurement (the fastest is kept)"), 1, 100)
      ->capture_default_str();
  b->add_option("--out", bench.out, "JSON file for the results");
}
#endif

// `mha help [COMMAND]` prints what --help prints; `mha WORD` for a WORD that is no command names it and
// the nearest command (CLI11 alone says "A subcommand is required"). Returns the exit status when it
// handled the command line, nothing when the first word is a command.
std::optional<int> help_or_unknown_command(CLI::App& app, int argc, char** argv) {
  const std::string word = argv[1];
  std::vector<std::string> shown;  // what --help lists: the hidden bench-one and bench-grid run but are not offered
  bool known = false;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    known = known || sub->get_name() == word;
    if (!sub->get_group().empty()) shown.push_back(sub->get_name());
  }
  if (known) return std::nullopt;
  if (word == "help") {
    if (argc == 2) return fmt::print("{}", app.help()), 0;
    const std::string topic = argv[2];
    for (const std::string& name : shown)
      if (name == topic) return fmt::print("{}", app.get_subcommand(name)->help(app.get_name())), 0;
    fmt::print(stderr, "mha: error: {}\n", mha_cli::terminal_safe(mha_cli::unknown_command_message(topic, shown)));
    return kExitUsage;
  }
  fmt::print(stderr, "mha: error: {}\n", mha_cli::terminal_safe(mha_cli::unknown_command_message(word, shown)));
  return kExitUsage;
}

// A standard descriptor that is closed (`mha ... >&-`) gets /dev/null opened the other way round, so
// that reading or writing it still fails (EBADF, as when closed) but no file the command opens takes
// its number: output meant for the terminal would otherwise land in that file.
void hold_closed_standard_descriptors() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int held = open("/dev/null", fd == 0 ? O_WRONLY : O_RDONLY);
    if (held != -1 && held != fd) dup2(held, fd), close(held);
  }
}

// The command's status, or kExitError when its output could not all be written: stdio reports a failed
// write only through ferror and the final flush (fmt::print throws only once its buffer fails), so a
// command whose few lines sat in the buffer would exit 0 having written nothing.
int check_standard_output(int status) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int error = flushed ? 0 : errno;  // unknown when an earlier write failed and this one had nothing left
  std::cout.flush();                      // unused here, but CLI11's default stream
  if (flushed && !std::ferror(stdout) && std::cout.good()) return status;
  // fprintf, not fmt::print: a standard error that fails too must not throw from here
  std::fprintf(stderr, "mha: error: cannot write the output to standard output%s%s\n", error != 0 ? ": " : "",
               error != 0 ? std::strerror(error) : "");
  return kExitError;
}

int command_line(int argc, char** argv) {
  CLI::App app{"mha: multi-head attention (\"Attention Is All You Need\", section 3.2)", "mha"};
  app.set_version_flag("--version", std::string("mha ") + MHA_VERSION);
  app.require_subcommand(1);
  mha_cli::DemoOptions demo_options;
  add_demo_command(app, demo_options);
  mha_cli::TranslateOptions translate_options;
  add_translate_command(app, translate_options);
  mha_cli::HeadsOptions heads_options;
  add_heads_command(app, heads_options);
  mha_cli::BenchOptions bench_options;
  add_bench_command(app, bench_options);
  mha_cli::RunOptions run_options;
  add_run_command(app, run_options);
  mha_cli::ExploreOptions explore_options;
  add_explore_command(app, explore_options);
  mha_cli::BenchOneOptions bench_one_options;
  add_bench_one_command(app, bench_one_options);
  mha_cli::BenchGridOptions bench_grid_options;
  add_bench_grid_command(app, bench_grid_options);
#ifdef MHA_HAVE_DISTRIBUTED
  mha_cli::RingCheckOptions ring_check_options;
  mha_cli::BenchRingOptions bench_ring_options;
  add_ring_commands(app, ring_check_options, bench_ring_options);
#endif

  if (argc >= 2 && argv[1][0] != '-') {
    if (const std::optional<int> status = help_or_unknown_command(app, argc, argv)) return *status;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // app.exit prints --help / --version (status 0) or the misuse (CLI11's own codes, 100+): we use 2.
    // Help and version go where every command's output goes (CLI11 writes std::cout): a failed write fails.
    std::ostringstream out;
    const int code = app.exit(e, out);
    if (std::fputs(out.str().c_str(), stdout) == EOF)  // as fmt::print, which throws its errno
      throw std::system_error(errno, std::generic_category(), "cannot write to standard output");
    return code == 0 ? 0 : kExitUsage;
  }

  try {
    if (app.got_subcommand("demo")) return mha_cli::run_demo(demo_options);
    if (app.got_subcommand("translate")) return mha_cli::run_translate(translate_options);
    if (app.got_subcommand("explore")) return mha_cli::run_explore(explore_options);
    if (app.got_subcommand("heads")) return mha_cli::run_heads(heads_options);
    if (app.got_subcommand("run")) return mha_cli::run_layer(run_options);
    if (app.got_subcommand("bench")) {
      std::string command;
      for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
      if (bench_options.decode) return mha_cli::bench::run_bench_decode(bench_options, command);
      if (bench_options.variants) return mha_cli::bench::run_bench_variants(bench_options, command);
      if (bench_options.torch_sdpa) {
        if (app.get_subcommand("bench")->count("--sizes") == 0) bench_options.sizes = {512, 1024, 2048, 4096, 8192};
        return mha_cli::bench::run_bench_torch_sdpa(bench_options, command);
      }
      if (bench_options.dtype == "bf16") {
        if (app.get_subcommand("bench")->count("--sizes") == 0) bench_options.sizes = {4096};
        return mha_cli::bench::run_bench_bf16(bench_options, command);
      }
      return mha_cli::run_bench(bench_options, command);
    }
    if (app.got_subcommand("bench-one")) return mha_cli::run_bench_one(bench_one_options);
    if (app.got_subcommand("bench-grid")) return mha_cli::run_bench_grid(bench_grid_options);
#ifdef MHA_HAVE_DISTRIBUTED
    if (app.got_subcommand("ring-check")) return mha_cli::run_ring_check(ring_check_options);
    if (app.got_subcommand("bench-ring")) return mha_cli::run_bench_ring(bench_ring_options);
#endif
  } catch (const std::exception& e) {  // mha::Error; files that cannot be written, unexpected results
    // Messages may quote file names and other text from outside: no control bytes reach the terminal.
    fmt::print(stderr, "mha: error: {}\n", mha_cli::terminal_safe(e.what()));
    return kExitError;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hold_closed_standard_descriptors();
  int status = kExitError;
  try {
    status = command_line(argc, argv);
  } catch (const std::exception& e) {  // a failed write outside the commands' handler (`mha help`), or in it
    std::fprintf(stderr, "mha: error: %s\n", mha_cli::terminal_safe(e.what()).c_str());
  }
  return check_standard_output(status);
}
