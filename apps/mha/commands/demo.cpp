// `mha demo` (demo.hpp): train, evaluate, draw, report.
//
// Legend: S source characters, T = 11 decoder positions (<bos> and the 10 characters of the date),
// h heads.
#include "commands/demo.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "commands/date_variations.hpp"
#include "commands/demo_fields.hpp"
#include "commands/demo_report.hpp"
#include "mha/attention.hpp"
#include "render/attention_map_png.hpp"
#include "render/learning_curve_svg.hpp"
#include "transformer/checkpoint.hpp"
#include "transformer/training.hpp"

namespace mha_cli {
namespace {

namespace tf = transformer;

// The held-out dates are DateSampler(HeldOut, seed + kHeldOutSeedOffset)'s first --eval (the checkpoint
// records both, for `mha explore`).
constexpr std::uint64_t kHeldOutSeedOffset = 1000;

tf::TransformerConfig model_config(const DemoOptions& o, const tf::Vocabulary& vocab) {
  tf::TransformerConfig c;
  c.vocab = vocab.size();
  c.d_model = o.d_model;
  c.heads = o.heads;
  c.d_ff = o.d_ff;
  c.encoder_layers = o.layers;
  c.decoder_layers = o.layers;
  c.pre_norm = o.pre_norm;
  c.dropout = o.dropout;
  c.attention_dropout = o.attention_dropout;
  c.compute = o.dtype == "bf16" ? tf::Compute::BFloat16 : tf::Compute::Native;
  return c;
}

tf::TrainingConfig training_config(const DemoOptions& o) {
  tf::TrainingConfig t;
  t.steps = o.steps;
  t.batch_size = o.batch_size;
  t.label_smoothing = o.label_smoothing;
  t.lr_factor = o.lr_factor;
  t.warmup = o.warmup;
  t.seed = o.seed;
  t.eval_every = o.eval_every;
  t.eval_examples = 200;
  return t;
}

// "step  1200/2400 [#########.........] loss 0.734  5321 tok/s  1:02 left", redrawn in place on a
// terminal, one line per tenth of the run otherwise.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled), tty_(isatty(fileno(stderr)) != 0) {}

  void operator()(const tf::Progress& p) {
    if (!enabled_) return;
    const bool tenth = p.step * 10 / p.steps != (p.step - 1) * 10 / p.steps;
    if (!tty_ && !tenth && p.step != 1) return;
    constexpr int kBarWidth = 24;
    const int filled = static_cast<int>(kBarWidth * p.step / p.steps);
    fmt::print(stderr, "{}step {:>5}/{} [{}{}] loss {:.3f}  {:.0f} tok/s  {} left{}", tty_ ? "\r" : "", p.step, p.steps,
               std::string(static_cast<std::size_t>(filled), '#'),
               std::string(static_cast<std::size_t>(kBarWidth - filled), '.'), p.loss, p.tokens_per_second,
               minutes(p.seconds_left), tty_ ? "" : "\n");
    if (tty_ && p.step == p.steps) fmt::print(stderr, "\n");
    mid_line_ = tty_ && p.step != p.steps;
  }

  // Ends the line a terminal's bar is drawn on, when training stops before its last step.
  void end_line() {
    if (mid_line_) fmt::print(stderr, "\n");
    mid_line_ = false;
  }

 private:
  bool enabled_, tty_, mid_line_ = false;
};

// ---- attention maps --------------------------------------------------------------------------------

// Labels of a token sequence for the axes, one character each so they fit their cell: "^" is <bos>,
// "_" a space.
std::vector<std::string> labels(const std::vector<int>& ids, const tf::Vocabulary& vocab) {
  std::vector<std::string> out;
  for (int id : ids) out.push_back(id == tf::Vocabulary::kBos ? "^" : vocab.token_label(id));
  return out;
}

// Head `head` of per-head weights [1, h, L, S] as an AttentionMap.
AttentionMap head_map(const mha::Tensor& weights, std::int64_t head, std::string title, std::vector<std::string> rows,
                      std::vector<std::string> cols) {
  AttentionMap map;
  const std::int64_t L = weights.size(2), S = weights.size(3);
  const float* w = weights.data_as<float>() + head * L * S;
  map.title = std::move(title);
  map.query_labels = std::move(rows);
  map.key_labels = std::move(cols);
  map.weights.assign(w, w + L * S);
  return map;
}

// field_share of every encoder-decoder head, layer by layer, from the weights the last forward kept.
std::vector<HeadShare> cross_shares(const tf::Transformer<float>& model, const tf::DateFields& fields) {
  std::vector<HeadShare> shares;
  for (std::int64_t layer = 0; layer < model.decoder_layers(); ++layer) {
    const mha::Tensor& weights = model.cross_weights(layer);  // [1, h, T, S]
    const std::int64_t T = weights.size(2), S = weights.size(3);
    for (std::int64_t head = 0; head < weights.size(1); ++head) {
      const float* w = weights.data_as<float>() + head * T * S;
      shares.push_back({layer, head, field_share({w, static_cast<std::size_t>(T * S)}, S, fields)});
    }
  }
  return shares;
}

// Runs the model on one held-out example (the decoder reading its own greedy output) with the
// attention weights kept, measures which encoder-decoder head reads the date's fields, and draws every
// layer and head of the three kinds of attention, the fields boxed on the encoder-decoder maps.
ExampleMaps draw_example(tf::Transformer<float>& model, const tf::Vocabulary& vocab, const tf::DateExample& example,
                         std::size_t index, const std::filesystem::path& dir) {
  tf::Batch batch = tf::make_batch(std::vector<tf::DateExample>{example}, vocab);
  tf::TokenBatch tokens = tf::token_batch(batch);
  const std::int64_t T = batch.target_len;
  tokens.target = model.greedy_decode(tokens, T, tf::Vocabulary::kBos, /*use_cache=*/true);  // y1 .. y10 <eos>
  ExampleMaps out;
  out.source = example.source;
  out.target = example.target;
  out.predicted = vocab.decode(tokens.target);
  out.fields = example.fields;
  tokens.target.insert(tokens.target.begin(), tf::Vocabulary::kBos);
  tokens.target.pop_back();  // <bos> y1 .. y10: the decoder's input when it wrote y1 .. y10 <eos>
  model.train(false);
  model.keep_attention_weights(true);
  model.forward(tokens);
  model.keep_attention_weights(false);
  out.cross_shares = cross_shares(model, example.fields);
  out.even_share = even_field_share(batch.source_len, example.fields);
  const HeadShare best = out.best();

  const std::vector<std::string> src = labels(batch.source, vocab), tgt = labels(tokens.target, vocab);
  struct Kind {
    const char* name;
    const char* slug;
    const mha::Tensor& (tf::Transformer<float>::*weights)(std::int64_t) const;
    std::int64_t layers;
    bool decoder_rows, source_cols;
  };
  using Model = tf::Transformer<float>;
  const Kind kinds[] = {
      {"encoder self-attention", "encoder_self", &Model::encoder_self_weights, model.encoder_layers(), false, true},
      {"decoder masked self-attention", "decoder_self", &Model::decoder_self_weights, model.decoder_layers(), true,
       false},
      {"encoder-decoder attention", "cross", &Model::cross_weights, model.decoder_layers(), true, true},
  };
  for (const Kind& kind : kinds) {
    const bool cross = kind.weights == &Model::cross_weights;
    KindMaps maps{kind.name, kind.slug, {}};
    for (std::int64_t layer = 0; layer < kind.layers; ++layer) {
      const mha::Tensor& weights = (model.*kind.weights)(layer);  // [1, h, L, S]
      std::vector<MapFigure> heads;
      for (std::int64_t head = 0; head < weights.size(1); ++head) {
        const std::string file = fmt::format("example{}_{}_layer{}_head{}.png", index, kind.slug, layer, head);
        std::string title = fmt::format("layer {} head {}", layer, head);
        if (cross)
          title += fmt::format(": {:.0f}% in the boxes",
                               100 * out.cross_shares[std::size_t(layer * weights.size(1) + head)].share);
        AttentionMap map = head_map(weights, head, title, kind.decoder_rows ? tgt : src, kind.source_cols ? src : tgt);
        if (cross) {
          map.highlights = field_boxes(example.fields);
          map.note = "boxes: where year, month, day are read";
        }
        write_attention_map_png(dir / file, map);
        heads.push_back({file, fmt::format("{}, layer {}, head {}", kind.name, layer, head),
                         cross && layer == best.layer && head == best.head});
      }
      maps.layers.push_back(std::move(heads));
    }
    out.kinds.push_back(std::move(maps));
  }
  return out;
}

// Held-out examples for the maps: one per format, from the formats whose alignment is most telling.
std::vector<tf::DateExample> map_examples(std::int64_t count, std::uint64_t seed) {
  const tf::DateFormat preferred[] = {
      tf::DateFormat::OrdinalWordsOfMonthYear, tf::DateFormat::WeekdayDayMonthYear,  tf::DateFormat::SlashDMY,
      tf::DateFormat::MonthOrdinalDayYear,     tf::DateFormat::ShortWeekdayDayMonYY, tf::DateFormat::DotYMD};
  std::vector<tf::DateExample> out;
  tf::DateSampler sampler(tf::Split::HeldOut, seed);
  for (tf::DateFormat format : preferred) {
    if (static_cast<std::int64_t>(out.size()) >= count) break;
    for (;;) {
      tf::DateExample e = sampler.next();
      if (e.format == format) {
        out.push_back(e);
        break;
      }
    }
  }
  return out;
}

// ---- evaluation ------------------------------------------------------------------------------------

// Beam search with K beams on the held-out sources, timed, against their targets and greedy's answers.
BeamEvaluation evaluate_beams(tf::Transformer<float>& model, const tf::Vocabulary& vocab,
                              const std::vector<tf::DateExample>& examples, const std::vector<std::string>& sources,
                              const std::vector<std::string>& greedy, std::int64_t beams) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const std::vector<tf::Translation> answers = tf::beam_translate(model, vocab, sources, beams);
  BeamEvaluation out;
  out.beams = beams;
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  int correct = 0;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    correct += answers[i].text == examples[i].target;
    out.differs_from_greedy += answers[i].text != greedy[i];
  }
  out.accuracy = examples.empty() ? 0.0 : static_cast<double>(correct) / static_cast<double>(examples.size());
  return out;
}

Evaluation evaluate(tf::Transformer<float>& model, const tf::Vocabulary& vocab,
                    const std::vector<tf::DateExample>& examples, const std::vector<std::int64_t>& beams) {
  std::vector<std::string> sources;
  for (const auto& e : examples) sources.push_back(e.source);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const std::vector<std::string> predicted = tf::translate(model, vocab, sources);
  const auto t1 = Clock::now();
  const std::vector<std::string> recomputed = tf::translate(model, vocab, sources, 250, /*use_cache=*/false);
  Evaluation ev;
  ev.cached_seconds = std::chrono::duration<double>(t1 - t0).count();
  ev.full_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  ev.same_outputs = predicted == recomputed;
  int correct = 0;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const bool ok = predicted[i] == examples[i].target;
    correct += ok;
    auto& [c, n] = ev.by_format[examples[i].format];
    c += ok;
    ++n;
    if (!ok) ev.wrong.emplace_back(examples[i], predicted[i]);
  }
  ev.accuracy = examples.empty() ? 0.0 : static_cast<double>(correct) / static_cast<double>(examples.size());
  for (const std::int64_t k : beams) ev.beams.push_back(evaluate_beams(model, vocab, examples, sources, predicted, k));
  return ev;
}

// The self-attention cache in float32, int8 and fp8 on the model `mha translate` runs (ev.caches), printed.
// When that is the model evaluate() decoded (a float32 run), the float32 row is evaluate()'s greedy and
// beam results (the same decoding: beam search with one beam is greedy's), not decoded again.
void evaluate_caches(tf::Transformer<float>& translator, bool evaluated, const tf::Vocabulary& vocab,
                     const std::vector<tf::DateExample>& examples, const DemoOptions& o, Evaluation& ev) {
  ev.cache_widths = {1};
  for (const std::int64_t k : o.beams)
    if (std::find(ev.cache_widths.begin(), ev.cache_widths.end(), k) == ev.cache_widths.end())
      ev.cache_widths.push_back(k);
  std::vector<mha::KVStorage> storages{mha::KVStorage::Int8, mha::KVStorage::Float8E4M3};
  if (!evaluated) storages.insert(storages.begin(), mha::KVStorage::Native);
  ev.caches = tf::evaluate_kv_caches(translator, vocab, examples, ev.cache_widths, storages);
  if (evaluated) {
    tf::KVCacheEvaluation float32;  // storage Native, mean KL 0
    for (const std::int64_t k : ev.cache_widths) {
      const auto b =
          std::find_if(ev.beams.begin(), ev.beams.end(), [k](const BeamEvaluation& e) { return e.beams == k; });
      float32.exact_match.push_back(k == 1 ? ev.accuracy : b->accuracy);
      float32.seconds += k == 1 ? ev.cached_seconds : b->seconds;
    }
    ev.caches.insert(ev.caches.begin(), float32);
  }
  fmt::print("  self-attention KV cache in each dtype (exact match; mean KL of the next-character distributions "
             "from float32's):\n");
  for (const tf::KVCacheEvaluation& c : ev.caches) {
    std::string accuracies;
    for (std::size_t i = 0; i < c.exact_match.size(); ++i)
      accuracies += fmt::format("{}{} {:.1f}%", i ? ", " : "",
                                ev.cache_widths[i] == 1 ? "greedy" : fmt::format("{} beams", ev.cache_widths[i]),
                                100 * c.exact_match[i]);
    fmt::print("    {:<8} {}; KL {} ({:.2f} s)\n", kv_cache_label(c.storage), accuracies, kl_text(c.mean_kl),
               c.seconds);
  }
}

void check_options(const DemoOptions& o) {
  if (o.d_model % o.heads != 0)
    throw std::runtime_error(fmt::format("--d-model {} is not a multiple of --heads {}", o.d_model, o.heads));
}

// Trains `model` with the demo's progress bar; a diverged run becomes an error that says what to change.
tf::TrainingResult train(tf::Transformer<float>& model, const tf::Vocabulary& vocab, const DemoOptions& o) {
  ProgressBar bar(o.progress);
  try {
    return tf::train_on_dates(model, vocab, training_config(o), std::ref(bar));
  } catch (const tf::TrainingDiverged& e) {
    bar.end_line();
    throw std::runtime_error(fmt::format(
        "{} (with these settings the learning rate is likely too high: try a smaller --lr-factor or a longer "
        "--warmup)",
        e.what()));
  }
}

// --dtype bf16: the same model, settings and seed trained in float32 first, in the same process, for
// the report's side-by-side of the training times; its accuracy on the same held-out dates.
Float32Run float32_run(const DemoOptions& o, const tf::Vocabulary& vocab,
                       const std::vector<tf::DateExample>& held_out) {
  DemoOptions float32 = o;
  float32.dtype = "float32";
  tf::Transformer<float> model(model_config(float32, vocab), o.seed);
  fmt::print("  training in float32 first, for the side-by-side: {} steps of {} examples ...\n", o.steps, o.batch_size);
  const tf::TrainingResult training = train(model, vocab, float32);
  Float32Run run{training.seconds, static_cast<double>(training.target_tokens) / training.seconds,
                 tf::exact_match(model, vocab, held_out)};
  fmt::print("  float32: trained in {} ({:.0f} target tokens/s), held-out exact match {:.1f}%\n", minutes(run.seconds),
             run.tokens_per_second, 100 * run.accuracy);
  return run;
}

// The model as `mha translate` runs it: `model`'s parameters (a bf16 run's float32 master weights) in a
// float32 model, in evaluation mode.
std::unique_ptr<tf::Transformer<float>> float32_model(tf::Transformer<float>& model) {
  tf::TransformerConfig c = model.config();
  c.compute = tf::Compute::Native;
  auto out = std::make_unique<tf::Transformer<float>>(c, 0);
  const tf::ParameterRefs<float> from = model.parameters(), to = out->parameters();
  for (std::size_t i = 0; i < from.size(); ++i) to[i]->value = from[i]->value;
  out->train(false);
  return out;
}

}  // namespace

int run_demo(const DemoOptions& o) {
  check_options(o);
  if (o.threads > 0) mha::set_num_threads(o.threads);
  const std::filesystem::path dir(o.out_dir);
  std::filesystem::create_directories(dir);

  const tf::Vocabulary vocab;
  tf::Transformer<float> model(model_config(o, vocab), o.seed);
  std::int64_t parameters = 0;
  for (const auto* p : model.parameters()) parameters += p->numel();
  fmt::print("mha demo: the paper's Transformer learns to read dates ({} layers x 2, d_model {}, {} heads, {} "
             "parameters)\n",
             o.layers, o.d_model, o.heads, parameters);
  fmt::print("  e.g. \"the fifth of March 2021\", \"Fri, 5 Mar 21\", \"05/03/2021\" (day first) -> 2021-03-05\n");
  const std::vector<tf::DateExample> held_out =
      tf::sample_dates(tf::Split::HeldOut, o.seed + kHeldOutSeedOffset, static_cast<std::size_t>(o.eval_examples));
  const bool mixed = o.dtype == "bf16";
  std::optional<Float32Run> float32;
  if (mixed) float32 = float32_run(o, vocab, held_out);
  fmt::print("  training {} steps of {} examples{} ...\n", o.steps, o.batch_size,
             mixed ? " in bfloat16 mixed precision" : "");
  const tf::TrainingResult training = train(model, vocab, o);

  Evaluation ev = evaluate(model, vocab, held_out, o.beams);
  fmt::print("  trained in {} ({:.0f} target tokens/s{})\n", minutes(training.seconds),
             static_cast<double>(training.target_tokens) / training.seconds,
             float32 ? fmt::format("; float32: {}", minutes(float32->seconds)) : "");
  fmt::print("  held-out exact match: {:.1f}% of {} ({} wrong)\n", 100 * ev.accuracy, held_out.size(), ev.wrong.size());
  for (std::size_t i = 0; i < ev.wrong.size() && i < 5; ++i)
    fmt::print("    \"{}\" -> {} (expected {})\n", ev.wrong[i].first.source, ev.wrong[i].second,
               ev.wrong[i].first.target);
  fmt::print("  greedy decoding of the {} dates: {:.2f} s through the KV cache, {:.2f} s recomputing every prefix; "
             "same outputs: {}\n",
             held_out.size(), ev.cached_seconds, ev.full_seconds, ev.same_outputs ? "yes" : "NO");
  for (const BeamEvaluation& b : ev.beams)
    fmt::print("  beam search, {} beams: {:.1f}% exact match in {:.2f} s (greedy: {:.1f}% in {:.2f} s); {} answers "
               "differ from greedy's\n",
               b.beams, 100 * b.accuracy, b.seconds, 100 * ev.accuracy, ev.cached_seconds, b.differs_from_greedy);

  // What `mha translate` will run: for a bf16 run, the float32 master weights decoded in float32.
  const std::unique_ptr<tf::Transformer<float>> masters = mixed ? float32_model(model) : nullptr;
  tf::Transformer<float>& translator = mixed ? *masters : model;
  if (float32) {
    float32->checkpoint_accuracy = tf::exact_match(translator, vocab, held_out);
    fmt::print("  the float32 master weights decoded in float32, as `mha translate` reads the checkpoint: {:.1f}%\n",
               100 * float32->checkpoint_accuracy);
  }
  evaluate_caches(translator, !mixed, vocab, held_out, o, ev);
  // `mha translate` marks answers the decoder is less sure of than of 99% of its correct held-out ones.
  const double unsure_below = tf::unsure_threshold(translator, vocab, held_out);
  fmt::print("  confidence (lowest token probability) below which `mha translate` marks an answer unsure: {:.4f}\n",
             unsure_below);
  // The ways people write dates, read as `mha translate` reads them (up to 200 held-out dates each).
  const std::vector<tf::DateExample> variation_dates(
      held_out.begin(), held_out.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(held_out.size(), 200)));
  const std::vector<VariationResult> variations = measure_variations(translator, vocab, variation_dates, unsure_below);
  fmt::print("  realistic variations, {} held-out dates each (right / marked ? / confidently wrong):\n",
             variation_dates.size());
  for (const VariationResult& v : variations)
    fmt::print("    {:<40} {:>4} / {:>4} / {:>4}   e.g. \"{}\"\n", v.name, v.right, v.unsure, v.confidently_wrong,
               v.example);
  std::map<std::string, std::string> meta{{"steps", std::to_string(o.steps)},
                                          {"seed", std::to_string(o.seed)},
                                          {"held_out_exact_match", fmt::format("{:.4f}", ev.accuracy)},
                                          {"unsure_below", fmt::format("{:.6f}", unsure_below)},
                                          {"held_out_seed", std::to_string(o.seed + kHeldOutSeedOffset)},
                                          {"held_out_examples", std::to_string(held_out.size())},
                                          {"trained_dtype", o.dtype}};
  tf::save_checkpoint(model, (dir / "checkpoint.safetensors").string(), meta);  // bf16: the float32 masters

  std::vector<ExampleMaps> maps;
  const std::vector<tf::DateExample> shown = map_examples(o.map_examples, o.seed + 2000);
  for (std::size_t i = 0; i < shown.size(); ++i) maps.push_back(draw_example(model, vocab, shown[i], i, dir));
  write_learning_curve_svg(dir / "learning_curve.svg", training.curve,
                           fmt::format("Training: {} heads, d_model {}", o.heads, o.d_model));
  const std::vector<OutsideAnswer> outside = answers_outside_the_range(translator, vocab, unsure_below);
  const DemoReport report{o,
                          parameters,
                          training,
                          ev,
                          held_out.size(),
                          unsure_below,
                          maps,
                          variations,
                          outside,
                          float32 ? &*float32 : nullptr};
  write_index(dir / "index.html", report);
  write_summary(dir / "summary.json", report);
  fmt::print("  wrote {}: index.html, learning_curve.svg, {} attention maps, checkpoint.safetensors, summary.json\n",
             dir.string(), maps.size() * static_cast<std::size_t>(o.heads * o.layers * 3));
  fmt::print("  try: mha translate --checkpoint {} \"Friday, 5 March 2021\"\n",
             (dir / "checkpoint.safetensors").string());
  return 0;
}

}  // namespace mha_cli
