// `mha heads`: runs the hand-built heads of heads_model.hpp through mha::MultiHeadAttention, measures
// how closely each head follows its rule, compares with one head of the same width, checks the
// results and draws the attention maps.
//
// Legend: L queries = S keys = the text's length, h heads, E = d_model, V symbol slots.
#include "commands/heads.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "commands/heads_model.hpp"
#include "mha/attention.hpp"
#include "mha/multi_head_attention.hpp"
#include "render/attention_map_png.hpp"
#include "render/attention_map_svg.hpp"
#include "render/image_index.hpp"

namespace mha_cli {
namespace {

using heads::kHeadRules;
using heads::kHeads;
using heads::Rule;
using heads::Sequence;

constexpr double kPassWeight = 0.9;         // a head passes when every query puts >= this on its rule's keys
constexpr double kAverageTolerance = 1e-5;  // averaged weights vs the mean of the per-head weights

using Matrix = std::vector<float>;  // [L, S] row-major

// How closely one attention map [L, S] follows one rule.
struct RuleScore {
  double mean_weight = 0;        // mean over queries of the weight on the rule's keys
  double worst_weight = 1;       // the smallest such weight
  std::int64_t argmax_hits = 0;  // queries whose largest weight falls on one of the rule's keys
};

// A space is drawn and printed as '_' so that it can be seen.
char shown(char c) { return c == ' ' ? '_' : c; }
std::string shown(const std::string& text) {
  std::string out = text;
  std::transform(out.begin(), out.end(), out.begin(), [](char c) { return shown(c); });
  return out;
}
std::string token_at(const Sequence& seq, std::int64_t j) {
  return fmt::format("{}{}", shown(seq.text[std::size_t(j)]), j);
}

std::int64_t argmax(const float* row, std::int64_t n) { return std::max_element(row, row + n) - row; }

// Head h of per-head weights [h, L, S] as an [L, S] matrix.
Matrix head_weights(const mha::Tensor& weights, std::int64_t h) {
  const std::int64_t n = weights.size(1) * weights.size(2);
  const float* p = weights.data_as<float>() + h * n;
  return Matrix(p, p + n);
}

RuleScore score_rule(const Matrix& w, Rule rule, const Sequence& seq) {
  const std::int64_t L = seq.length();
  RuleScore score;
  for (std::int64_t i = 0; i < L; ++i) {
    const float* row = &w[std::size_t(i * L)];
    const auto targets = heads::rule_targets(rule, seq, i);
    double mass = 0;
    for (std::int64_t j : targets) mass += row[j];
    score.mean_weight += mass / double(L);
    score.worst_weight = std::min(score.worst_weight, mass);
    if (std::find(targets.begin(), targets.end(), argmax(row, L)) != targets.end()) ++score.argmax_hits;
  }
  return score;
}

// The symbols read back from block b of the output out [L, E] = [L, h*V] (W^O = I puts head b's
// d_v = V values there): for each query, the symbol whose one-hot slot holds the most weight.
std::string decode_block(const mha::Tensor& out, std::int64_t block, const Sequence& seq) {
  const std::int64_t n_symbols = std::int64_t(seq.symbols.size());
  std::string decoded;
  for (std::int64_t i = 0; i < seq.length(); ++i) {
    const float* slots = out.data_as<float>() + i * out.size(1) + block * heads::kTokenSlots;
    decoded += seq.symbols[std::size_t(argmax(slots, n_symbols))];
  }
  return decoded;
}

// What block b of the output should decode to when head b follows its rule: the symbol of its key.
std::string expected_output(Rule rule, const Sequence& seq) {
  std::string expected;
  for (std::int64_t i = 0; i < seq.length(); ++i) {
    expected += seq.text[std::size_t(heads::rule_targets(rule, seq, i)[0])];
  }
  return expected;
}

std::int64_t count_equal(const std::string& a, const std::string& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += a[i] == b[i];
  return n;
}

// The [L, S] cells that any of `rules` designates.
std::vector<std::uint8_t> rule_cells(const std::vector<Rule>& rules, const Sequence& seq) {
  const std::int64_t L = seq.length();
  std::vector<std::uint8_t> cells(std::size_t(L * L), 0);
  for (Rule rule : rules) {
    for (std::int64_t i = 0; i < L; ++i) {
      for (std::int64_t j : heads::rule_targets(rule, seq, i)) cells[std::size_t(i * L + j)] = 1;
    }
  }
  return cells;
}

// Runs `layer` on X [L, E] as self-attention and returns {out [L, E], weights [h, L, S] or [L, S]}.
mha::MultiHeadAttentionOutput self_attention(mha::MultiHeadAttention& layer, const mha::Tensor& x, bool average) {
  mha::MultiHeadAttentionInputs inputs;
  inputs.need_weights = true;
  inputs.average_attn_weights = average;
  auto result = layer.forward(x, x, x, inputs);
  const std::int64_t L = x.size(0), h = layer.config().num_heads;
  const mha::Shape want_weights = average ? mha::Shape{L, L} : mha::Shape{h, L, L};
  if (result.out.shape() != x.shape() || result.weights.shape() != want_weights ||
      result.weights.dtype() != mha::DType::Float32) {
    throw std::runtime_error(fmt::format("forward returned out {} and weights {}, expected {} and {}",
                                         mha::shape_str(result.out.shape()), mha::shape_str(result.weights.shape()),
                                         mha::shape_str(x.shape()), mha::shape_str(want_weights)));
  }
  return result;
}

// Everything `mha heads` measures, computed before anything is printed.
struct Results {
  Sequence seq;
  mha::MultiHeadAttentionConfig four_heads, one_head;  // the two layers' configs, defaults resolved
  mha::Tensor per_head;                                // [h, L, S] four-head weights, average_attn_weights = false
  Matrix average;                                      // [L, S] the same layer's average_attn_weights = true
  Matrix single;                                       // [L, S] the one-head layer's weights
  std::vector<RuleScore> scores;                       // [h] head h against its own rule
  std::vector<std::string> decoded;                    // [h] block h of the four-head output, decoded (L symbols)
  std::vector<std::string> expected;                   // [h] what block h should decode to
  std::string single_decoded;                          // the one-head output, decoded (its four blocks are equal)
  std::int64_t four_head_answers = 0;                  // (query, rule) pairs the four-head output gets right
  std::int64_t single_answers = 0;                     // the same for the one-head output
  double average_error = 0;                            // max |average - mean over heads of per_head|
};

Results compute(const Sequence& seq) {
  const std::int64_t L = seq.length();
  const mha::Tensor x = heads::embed(seq);  // X: [L, E]
  Results r;
  r.seq = seq;

  mha::MultiHeadAttention layer(heads::multi_head_config());
  layer.eval();
  heads::load_projections(layer, heads::multi_head_projections(seq));
  const auto per_head = self_attention(layer, x, /*average=*/false);  // out [L, E], weights [h, L, S]
  const auto averaged = self_attention(layer, x, /*average=*/true);   // weights [L, S]
  r.four_heads = layer.config();
  r.per_head = per_head.weights.clone();
  r.average.assign(averaged.weights.data_as<float>(), averaged.weights.data_as<float>() + L * L);

  mha::MultiHeadAttention single(heads::single_head_config());
  single.eval();
  heads::load_projections(single, heads::single_head_projections(seq));
  const auto one = self_attention(single, x, /*average=*/true);  // out [L, E], weights [L, S]
  r.one_head = single.config();
  r.single.assign(one.weights.data_as<float>(), one.weights.data_as<float>() + L * L);
  r.single_decoded = decode_block(one.out, 0, seq);

  for (std::int64_t h = 0; h < kHeads; ++h) {
    const Rule rule = kHeadRules[std::size_t(h)];
    r.scores.push_back(score_rule(head_weights(r.per_head, h), rule, seq));
    r.decoded.push_back(decode_block(per_head.out, h, seq));
    r.expected.push_back(expected_output(rule, seq));
    r.four_head_answers += count_equal(r.decoded.back(), r.expected.back());
    r.single_answers += count_equal(r.single_decoded, r.expected.back());
  }
  for (std::int64_t k = 0; k < L * L; ++k) {
    double mean = 0;
    for (std::int64_t h = 0; h < kHeads; ++h) mean += r.per_head.data_as<float>()[h * L * L + k] / double(kHeads);
    r.average_error = std::max(r.average_error, std::abs(mean - double(r.average[std::size_t(k)])));
  }
  return r;
}

void print_report(const Results& r) {
  const Sequence& seq = r.seq;
  const std::int64_t L = seq.length();
  const auto& cfg = r.four_heads;
  fmt::print("mha heads: four attention heads built by hand, each attending by one rule (paper section 3.2.2)\n\n");
  fmt::print("  text    \"{}\"  ({} tokens, one per character; '_' is a space)\n", shown(seq.text), L);
  fmt::print(
      "  layer   MultiHeadAttention: d_model {} ({} symbol + {} position one-hot), h = {}, d_k = {}, d_v = {},\n",
      cfg.d_model, heads::kTokenSlots, heads::kPositionSlots, cfg.num_heads, cfg.d_k, cfg.d_v);
  fmt::print("          float32, eval mode, weights set with load_state_dict (constructed, not trained), "
             "{} threads\n",
             mha::num_threads());
  fmt::print("  call    forward(X, X, X), X [{}, {}], need_weights, average_attn_weights = false -> weights {}\n\n", L,
             cfg.d_model, mha::shape_str(r.per_head.shape()));

  // Per head: how much weight lands where its rule says, and three example queries "query -> key".
  const std::vector<std::int64_t> examples = {L / 5, L / 2, (4 * L) / 5};
  fmt::print("  head  rule            weight on the rule's keys   largest weight   e.g. query -> key\n");
  fmt::print("                        mean     worst query        on a rule key\n");
  for (std::int64_t h = 0; h < kHeads; ++h) {
    const Matrix w = head_weights(r.per_head, h);
    const RuleScore& s = r.scores[std::size_t(h)];
    std::string eg;
    for (std::int64_t i : examples) {
      if (!eg.empty()) eg += "   ";
      eg += fmt::format("{:>3} -> {:<3}", token_at(seq, i), token_at(seq, argmax(&w[std::size_t(i * L)], L)));
    }
    eg.erase(eg.find_last_not_of(' ') + 1);
    fmt::print("  {:<4}  {:<14}  {:<7.4f}  {:<17.4f}  {:>2}/{:<12} {}\n", h,
               heads::rule_name(kHeadRules[std::size_t(h)]), s.mean_weight, s.worst_weight, s.argmax_hits, L, eg);
  }

  fmt::print("\n  where each query puts its largest weight (key position):\n");
  std::string symbols_row, positions_row;
  for (std::int64_t i = 0; i < L; ++i) {
    symbols_row += fmt::format("{:>3}", shown(seq.text[std::size_t(i)]));
    positions_row += fmt::format("{:>3}", i);
  }
  fmt::print("    {:<21}{}\n    {:<21}{}\n", "", symbols_row, "query", positions_row);
  for (std::int64_t h = 0; h < kHeads; ++h) {
    const Matrix w = head_weights(r.per_head, h);
    std::string row;
    for (std::int64_t i = 0; i < L; ++i) row += fmt::format("{:>3}", argmax(&w[std::size_t(i * L)], L));
    fmt::print("    head {} {:<14}{}\n", h, heads::rule_name(kHeadRules[std::size_t(h)]), row);
  }

  fmt::print(
      "\n  the output out = Concat(head_1, ..., head_4) W^O, W^O = I: each head's {} values decoded to a symbol\n",
      cfg.d_v);
  fmt::print("    {:<22}\"{}\"\n", "text", shown(seq.text));
  for (std::int64_t h = 0; h < kHeads; ++h) {
    fmt::print("    head {} {:<15}\"{}\"\n", h, heads::rule_name(kHeadRules[std::size_t(h)]),
               shown(r.decoded[std::size_t(h)]));
  }

  fmt::print("\n  one head instead of four (h = 1, d_k = {}, d_v = {}): its query map is the sum of the four heads',\n"
             "  so its logits are the sums of theirs, and its one softmax per query must serve every rule:\n",
             r.one_head.d_k, r.one_head.d_v);
  fmt::print("    rule            weight on the rule's keys          largest weight on a rule key\n");
  fmt::print("                    one head   mean of the 4 maps      one head\n");
  for (Rule rule : kHeadRules) {
    const RuleScore s = score_rule(r.single, rule, seq);
    fmt::print("    {:<14}  {:<9.4f}  {:<22.4f}  {:>2}/{}\n", heads::rule_name(rule), s.mean_weight,
               score_rule(r.average, rule, seq).mean_weight, s.argmax_hits, L);
  }
  fmt::print("    its output (the same blend in all four blocks) decodes to \"{}\"\n", shown(r.single_decoded));
  fmt::print("    (query, rule) pairs the output answers: one head {}/{}, four heads {}/{}\n", r.single_answers,
             kHeads * L, r.four_head_answers, kHeads * L);
  fmt::print("    (average_attn_weights = true matches the mean of the per-head maps to {:.1e})\n", r.average_error);

  fmt::print("\n  What this shows: the four heads read the same tokens through different projections (positions\n"
             "  for heads 0, 1, 3; symbols for head 2), so one layer attends to four positions at once and its\n"
             "  output carries four different tokens. A single head has one softmax per query: it follows the\n"
             "  rules that agree and blends the rest (\"with a single attention head, averaging inhibits this\").\n");
}

// Writes one PNG and one SVG per map, and index.html, into `dir`; prints the paths.
void write_figures(const Results& r, const std::filesystem::path& dir) {
  struct Figure {
    std::string stem;     // file name without extension
    std::string caption;  // for index.html
    AttentionMap map;
  };
  const Sequence& seq = r.seq;
  const std::int64_t L = seq.length();
  std::vector<std::string> labels;
  for (char c : seq.text) labels.emplace_back(1, shown(c));

  std::vector<Figure> figures;
  for (std::int64_t h = 0; h < kHeads; ++h) {
    const Rule rule = kHeadRules[std::size_t(h)];
    const RuleScore& s = r.scores[std::size_t(h)];
    figures.push_back(
        {fmt::format("head{}_{}", h, heads::rule_slug(rule)),
         fmt::format("Head {}, {}: mean weight {:.4f} on the rule's keys (outlined), largest weight "
                     "on a rule key for {}/{} queries.",
                     h, heads::rule_name(rule), s.mean_weight, s.argmax_hits, L),
         {fmt::format("head {}: {}", h, heads::rule_name(rule)), labels, labels, head_weights(r.per_head, h),
          rule_cells({rule}, seq), "outlined: the keys its rule designates"}});
  }
  const std::vector<Rule> all_rules(kHeadRules.begin(), kHeadRules.end());
  figures.push_back({"heads_average",
                     "The mean of the four heads' maps (average_attn_weights = true, PyTorch's default): the rules "
                     "blur together. Outlined: the keys of any rule.",
                     {"mean of the 4 heads", labels, labels, r.average, rule_cells(all_rules, seq),
                      "outlined: the keys of any of the four rules"}});
  figures.push_back({"single_head",
                     "One head whose logits are the sums of the four heads' logits: per query it follows the rules "
                     "that agree and blends the rest. Outlined: the keys of any rule.",
                     {"one head, rules summed", labels, labels, r.single, rule_cells(all_rules, seq),
                      "outlined: the keys of any of the four rules"}});

  std::vector<IndexEntry> entries;
  fmt::print("\n  attention maps (rows: queries, columns: keys; outlined: the keys the rule designates):\n");
  for (const Figure& f : figures) {
    write_attention_map_png(dir / (f.stem + ".png"), f.map);
    write_attention_map_svg(dir / (f.stem + ".svg"), f.map);
    entries.push_back({f.stem + ".png", f.caption});
    fmt::print("    {}  (and .svg)\n", (dir / (f.stem + ".png")).string());
  }
  write_image_index(dir / "index.html", "mha heads: four hand-built attention heads",
                    {fmt::format("Text \"{}\" ({} tokens, '_' is a space), d_model {}, h = {}, d_k = {}, d_v = {}. "
                                 "Each head's projections were constructed so that it attends by one rule.",
                                 shown(seq.text), L, r.four_heads.d_model, r.four_heads.num_heads, r.four_heads.d_k,
                                 r.four_heads.d_v),
                     "Rows are queries, columns are keys; white is weight 0, dark blue weight 1. Each image also "
                     "exists as .svg, where hovering a cell shows its exact weight."},
                    entries);
  fmt::print("    {}\n", (dir / "index.html").string());
}

// The run as a check: what failed, or nothing.
std::vector<std::string> check(const Results& r) {
  const std::int64_t L = r.seq.length();
  std::vector<std::string> failures;
  for (std::int64_t h = 0; h < kHeads; ++h) {
    const RuleScore& s = r.scores[std::size_t(h)];
    const char* name = heads::rule_name(kHeadRules[std::size_t(h)]);
    if (s.argmax_hits != L || s.worst_weight < kPassWeight) {
      failures.push_back(fmt::format("head {} ({}): largest weight on a rule key for {}/{} queries, worst weight on "
                                     "the rule's keys {:.4f} (want {}/{} and >= {})",
                                     h, name, s.argmax_hits, L, s.worst_weight, L, L, kPassWeight));
    }
    if (r.decoded[std::size_t(h)] != r.expected[std::size_t(h)]) {
      failures.push_back(fmt::format("head {} ({}): output decodes to \"{}\", expected \"{}\"", h, name,
                                     shown(r.decoded[std::size_t(h)]), shown(r.expected[std::size_t(h)])));
    }
  }
  if (!(r.average_error <= kAverageTolerance)) {
    failures.push_back(fmt::format(
        "average_attn_weights = true differs from the mean of the per-head weights by {:.3e}", r.average_error));
  }
  return failures;
}

}  // namespace

int run_heads(const HeadsOptions& options) {
  const Sequence seq = heads::make_sequence(options.text);
  const std::filesystem::path dir(options.out_dir);
  std::filesystem::create_directories(dir);  // first, so that a bad --out fails before the work
  if (options.threads > 0) mha::set_num_threads(options.threads);

  const Results results = compute(seq);
  print_report(results);
  write_figures(results, dir);  // also when the check fails: the maps show what went wrong

  const std::vector<std::string> failures = check(results);
  for (const std::string& f : failures) fmt::print(stderr, "mha: error: heads check failed: {}\n", f);
  if (!failures.empty()) return 1;
  fmt::print("\n  check passed: every head puts its largest weight on its rule's key for {0}/{0} queries and at least\n"
             "  {1} of its weight there, and the output decodes to the tokens the rules designate.\n",
             seq.length(), kPassWeight);
  return 0;
}

}  // namespace mha_cli
