// The demo's index.html and summary.json (demo_report.hpp).
#include "commands/demo_report.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands/demo_fields.hpp"
#include "render/xml_escape.hpp"

namespace mha_cli {
namespace {

namespace tf = transformer;

constexpr double kTargetAccuracy = 0.99;  // the goal, with kTargetSeconds on this machine's 2 cores
constexpr double kTargetSeconds = 180;

std::string percent(double share) { return fmt::format("{:.0f}%", 100 * share); }

std::string css_colour(Rgb c) { return fmt::format("rgb({},{},{})", c.r, c.g, c.b); }

// A small outlined square in a field's colour, as the maps draw its box, then its name.
std::string legend_box(const DateFieldStyle& f) {
  return fmt::format("<span class=\"box\" style=\"border-color:{}\"></span> {}", css_colour(f.colour), f.name);
}

std::string settings_rows(const DemoOptions& o, std::int64_t parameters) {
  const std::pair<const char*, std::string> rows[] = {
      {"layers (encoder, decoder)", fmt::format("{}, {}", o.layers, o.layers)},
      {"d_model, heads, d_k = d_v", fmt::format("{}, {}, {}", o.d_model, o.heads, o.d_model / o.heads)},
      {"d_ff", std::to_string(o.d_ff)},
      {"normalisation", o.pre_norm ? "pre-norm" : "post-norm (the paper's)"},
      {"dropout (residual, attention)", fmt::format("{}, {}", o.dropout, o.attention_dropout)},
      {"label smoothing", fmt::format("{}", o.label_smoothing)},
      {"Adam", "beta1 0.9, beta2 0.98, eps 1e-9"},
      {"learning rate", fmt::format("{} * d_model^-0.5 * min(step^-0.5, step * {}^-1.5)", o.lr_factor, o.warmup)},
      {"steps x batch", fmt::format("{} x {}", o.steps, o.batch_size)},
      {"precision", o.dtype == "bf16" ? "bfloat16 mixed precision (float32 master weights)" : "float32"},
      {"seed", std::to_string(o.seed)},
      {"parameters", std::to_string(parameters)},
  };
  std::string html;
  for (const auto& [name, value] : rows)
    html += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", name, xml_escape(value));
  return html;
}

const char* kStyle =
    "<style>body{font-family:sans-serif;max-width:80em;margin:2em auto;padding:0 1em;line-height:1.4}"
    "table.s th{text-align:left;padding-right:1em;font-weight:normal;color:#555}"
    "table.s td{padding-right:1em}"
    "td.maps img{width:100%;image-rendering:pixelated}td.maps{vertical-align:top;padding:4px}"
    "td.maps.best{outline:4px solid #222}td.maps p{margin:0;font-weight:bold}"
    ".explain{display:grid;grid-template-columns:minmax(0,3fr) minmax(0,2fr);gap:2em;align-items:start}"
    ".explain figure{margin:0}.explain img{width:100%;image-rendering:pixelated}"
    ".box{display:inline-block;width:1.1em;height:.8em;border:3px solid;vertical-align:middle}"
    "p.finding{background:#f4f7fb;padding:.5em 1em}"
    "code{background:#f3f3f3;padding:0 .3em}code.line{white-space:pre}</style>";

// --dtype bf16: the mixed-precision run beside the float32 run of the same settings and seed.
std::string precision_comparison(const DemoReport& r) {
  const Float32Run& f = *r.float32;
  const double bf16_tokens = static_cast<double>(r.training.target_tokens) / r.training.seconds;
  std::string html = fmt::format(
      "<p>This model was trained in <b>bfloat16 mixed precision</b>: bf16 products with float32 accumulation (the "
      "attention layers and every linear map), float32 master weights updated by Adam, float32 layer norm, "
      "residual sums and loss. The same settings and seed trained in float32 first, in the same command:</p>\n"
      "<table class=\"s\" id=\"precision\">\n<tr><th>precision</th><th>training time</th><th>target tokens/s</th>"
      "<th>held-out exact match ({} dates)</th></tr>\n",
      r.eval_count);
  html += fmt::format("<tr><td>float32</td><td>{}</td><td>{:.0f}</td><td>{:.1f}%</td></tr>\n", minutes(f.seconds),
                      f.tokens_per_second, 100 * f.accuracy);
  html += fmt::format("<tr><td>bf16 mixed precision</td><td>{}</td><td>{:.0f}</td><td>{:.1f}%</td></tr>\n</table>\n",
                      minutes(r.training.seconds), bf16_tokens, 100 * r.evaluation.accuracy);
  return html + fmt::format("<p>The checkpoint holds the float32 master weights; decoded in float32, as <code>mha "
                            "translate</code> reads them, they get {:.1f}%.</p>\n",
                            100 * f.checkpoint_accuracy);
}

// Greedy decoding beside beam search of each --beams width, on the same held-out dates.
std::string beam_comparison(const DemoReport& r) {
  const Evaluation& ev = r.evaluation;
  std::string html = fmt::format(
      "<p>Greedy decoding takes the likeliest character at each step; beam search keeps the K likeliest "
      "partial answers (by the sum of their characters' log-probabilities) and returns the likeliest complete one. "
      "Its beams keep their keys and values in the library's paged KV cache, sharing the pages of their common "
      "prefix.</p>\n<table class=\"s\" id=\"beams\">\n<tr><th>decoding</th><th>held-out exact match ({} "
      "dates)</th><th>decode time</th><th>answers unlike greedy's</th></tr>\n"
      "<tr><td>greedy</td><td>{:.1f}%</td><td>{:.2f} s</td><td></td></tr>\n",
      r.eval_count, 100 * ev.accuracy, ev.cached_seconds);
  for (const BeamEvaluation& b : ev.beams)
    html += fmt::format("<tr><td>beam search, {} beams</td><td>{:.1f}%</td><td>{:.2f} s</td><td>{}</td></tr>\n",
                        b.beams, 100 * b.accuracy, b.seconds, b.differs_from_greedy);
  return html + "</table>\n";
}

// Greedy decoding and beam search with the self-attention cache in float32, int8 and fp8.
std::string cache_comparison(const DemoReport& r) {
  const Evaluation& ev = r.evaluation;
  const std::int64_t d_k = r.options.d_model / r.options.heads;
  std::string html = fmt::format(
      "<p>The decoder's self-attention keys and values can also be kept quantized in the paged KV cache (<code>mha "
      "translate --kv-cache</code>): int8, or fp8 (e4m3), one byte per element and one float32 scale per position "
      "and head ({} bytes a row of d_k = {} against float32's {}){}. Exact match on the same {} held-out dates, and "
      "the mean KL divergence KL(float32 || cache) of the next-character distributions, taken along the float32 "
      "cache's greedy answer (every cache reading the same prefixes), averaged over its steps and the dates:</p>\n"
      "<table class=\"s\" id=\"kv-cache\">\n<tr><th>cache</th>",
      d_k + 4, d_k, 4 * d_k, r.float32 ? "; here the float32 master weights, decoded in float32" : "", r.eval_count);
  for (const std::int64_t k : ev.cache_widths)
    html += k == 1 ? std::string("<th>greedy</th>") : fmt::format("<th>{} beams</th>", k);
  html += "<th>mean KL from float32</th><th>decode time</th></tr>\n";
  for (const tf::KVCacheEvaluation& c : ev.caches) {
    html += fmt::format("<tr><td>{}</td>", kv_cache_label(c.storage));
    for (const double a : c.exact_match) html += fmt::format("<td>{:.1f}%</td>", 100 * a);
    html += fmt::format("<td>{}</td><td>{:.2f} s</td></tr>\n", kl_text(c.mean_kl), c.seconds);
  }
  return html + "</table>\n";
}

// The result, the settings and the learning curve.
std::string result_section(const DemoReport& r) {
  const Evaluation& ev = r.evaluation;
  std::string html = fmt::format(
      "<h2>Result</h2>\n<p><b>{:.1f}%</b> exact match on {} held-out dates after {} of training on this machine "
      "(the goal: {:.0f}% within {}).</p>\n",
      100 * ev.accuracy, r.eval_count, minutes(r.training.seconds), 100 * kTargetAccuracy, minutes(kTargetSeconds));
  html += fmt::format("<p>Greedy decoding of the {} dates took {:.2f} s through the library's KV cache (each step "
                      "attends for the new position only) and {:.2f} s recomputing every prefix; the two wrote {} "
                      "outputs.</p>\n",
                      r.eval_count, ev.cached_seconds, ev.full_seconds, ev.same_outputs ? "the same" : "DIFFERENT");
  if (!ev.beams.empty()) html += beam_comparison(r);
  if (!ev.caches.empty()) html += cache_comparison(r);
  if (r.float32) html += precision_comparison(r);
  html += "<table class=\"s\">\n" + settings_rows(r.options, r.parameters) + "</table>\n";
  return html + "<h2>Learning curve</h2>\n<img src=\"learning_curve.svg\" alt=\"learning curve\">\n";
}

// Every trained format in words, with 5 March 2021 written in it, and the held-out score.
std::string formats_section(const Evaluation& ev) {
  std::string html =
      "<h2>Accuracy by format</h2>\n<p>The ways of writing a date the model was trained on, each with "
      "5 March 2021 as an example. Numbers with slashes or dots are read day first (05/03/2021 is the fifth of "
      "March) unless they start with the four-digit year.</p>\n<table class=\"s\"><tr><th>format</th>"
      "<th>example</th><th>right on held-out dates</th></tr>\n";
  for (const tf::DateFormat f : tf::all_date_formats()) {
    const auto it = ev.by_format.find(f);
    const std::string score =
        it == ev.by_format.end() ? "none drawn" : fmt::format("{}/{}", it->second.first, it->second.second);
    html += fmt::format("<tr><th>{}</th><td><code>{}</code></td><td>{}</td></tr>\n",
                        xml_escape(tf::format_description(f)), xml_escape(tf::format_date({2021, 3, 5}, f)), score);
  }
  return html + "</table>\n";
}

// The years the model reads, and what `mha translate` does outside them, with this model's answers.
std::string range_section(const DemoReport& r) {
  std::string html = fmt::format(
      "<h2>What it reads, and what happens outside that</h2>\n<p>Dates of the years {0} to {1} only. A two-digit "
      "year is read as 19xx from 50 to 99 and as 20xx from 00 to 49 (&ldquo;21&rdquo; is 2021, &ldquo;75&rdquo; is "
      "1975). <code>mha translate</code> reads its input as the trained formats write it: spacing, trailing periods "
      "and commas, and the letter case of month and weekday names do not matter.</p>\n"
      "<p>For a date outside that range, or one no calendar has, the model still writes an answer, but "
      "<code>mha translate</code> checks every answer and marks the ones it cannot vouch for: the line starts with <code>?</code>, then the answer, two spaces and the reason "
      "(not a calendar date; outside {0}-{1}; not the year the input states; or the decoder less sure than the "
      "threshold of {2:.4f} calibrated on held-out dates), and the command exits with status 3 instead of 0. An "
      "input it cannot read at all (empty, over 256 characters, or with a character other than letters, digits, "
      "space and <code>, . / - '</code>) gets the line <code>? not translated: REASON</code> and exit status 1. "
      "What it prints with this model:</p>\n<table class=\"s\"><tr><th>input</th><th><code>mha translate</code> "
      "prints</th></tr>\n",
      tf::kFirstYear, tf::kLastYear, r.unsure_below);
  for (const OutsideAnswer& a : r.outside)
    html += fmt::format("<tr><th>{}</th><td><code class=\"line\">{}</code></td></tr>\n", xml_escape(a.input),
                        xml_escape(a.line));
  return html + "</table>\n";
}

std::string variations_section(const std::vector<VariationResult>& variations) {
  std::string html =
      "<h2>Realistic variations</h2>\n<p>Dates written the ways people write them, not only as trained, "
      "read as <code>mha translate</code> reads them: spacing, trailing periods and the case of month names "
      "normalised, then each answer checked (a calendar date of 1950-2049, the year the input states) and its "
      "confidence compared with the threshold calibrated on held-out data. <i>Marked</i> answers start with "
      "<code>?</code>; a <i>confidently wrong</i> one is what the checks exist to prevent.</p>\n"
      "<table class=\"s\"><tr><th>written as</th><th>example</th><th>right</th><th>marked ?</th>"
      "<th>confidently wrong</th></tr>\n";
  for (const VariationResult& v : variations)
    html += fmt::format("<tr><th>{}</th><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td></tr>\n", xml_escape(v.name),
                        xml_escape(v.example), v.right, v.total, v.unsure, v.confidently_wrong);
  return html + "</table>\n";
}

std::string mistakes_section(const Evaluation& ev) {
  if (ev.wrong.empty()) return "";
  std::string html = "<h2>Mistakes (up to 20)</h2>\n<table class=\"s\">\n";
  for (std::size_t i = 0; i < ev.wrong.size() && i < 20; ++i)
    html += fmt::format("<tr><th>{}</th><td>wrote {}, expected {}</td></tr>\n", xml_escape(ev.wrong[i].first.source),
                        xml_escape(ev.wrong[i].second), ev.wrong[i].first.target);
  return html + "</table>\n";
}

// The image file of the best encoder-decoder head's map of `e`, or "" when it has none.
std::string best_map_file(const ExampleMaps& e) {
  for (const KindMaps& kind : e.kinds)
    for (const auto& heads : kind.layers)
      for (const MapFigure& f : heads)
        if (f.best) return f.file;
  return "";
}

// What a query, a key (and value) and a head are, next to the first map; the three kinds of attention;
// how to read a map and what to look for on it.
std::string explanation_section(const DemoReport& r) {
  const std::int64_t d_k = r.options.d_model / r.options.heads;
  std::string html = fmt::format(
      "<h2>What the heads attend to</h2>\n<div class=\"explain\"><div>\n"
      "<p>The model handles a date as characters. The <b>encoder</b> reads the source, one position per "
      "character; the <b>decoder</b> writes the answer one character at a time, each step seeing what it has "
      "written so far. At every position, in every layer, the model looks at other positions through "
      "<i>attention</i>:</p>\n"
      "<p id=\"query\"><b>A query</b> is what a position is looking for. Every character (a source character in "
      "the encoder, a character written so far in the decoder) turns what the model knows about it into a query "
      "of {0} numbers. When the decoder is about to write the month, its query asks, in effect, &ldquo;where is "
      "the month?&rdquo;. In a map, each row is one query.</p>\n"
      "<p id=\"key\"><b>A key</b> is how a position says what it holds: every character also gets a key of {0} "
      "numbers. Each query is compared with every key (a dot product, divided by &radic;{0}), and a softmax "
      "turns a row of scores into weights that are positive and sum to 1: how much the query's position takes "
      "from each key's position. What it takes is that position's <b>value</b>, a third vector: the query's "
      "position receives the weighted average of the values. In a map, each column is one key.</p>\n"
      "<p id=\"head\"><b>A head</b> is one set of learned projections that make the queries, keys and values. "
      "This model has {1} heads in every attention layer, side by side, and {2} layers each in the encoder and "
      "the decoder; each head works on its own {0} numbers and learns its own idea of what to look for (one may "
      "follow the year while another follows the day), and their results are joined. Each map below shows one "
      "head of one layer.</p>\n</div>\n",
      d_k, r.options.heads, r.options.layers);
  if (!r.examples.empty()) {
    const HeadShare best = r.examples.front().best();
    html += fmt::format(
        "<figure><img src=\"{}\" alt=\"the first map\"><figcaption>The first map: encoder-decoder attention, "
        "layer {} head {}, on &ldquo;{}&rdquo;. Rows: the decoder's steps (<code>^</code>, then the answer as "
        "written); columns: the source's characters; boxes: {}, {}, {}.</figcaption></figure>\n",
        best_map_file(r.examples.front()), best.layer, best.head, xml_escape(r.examples.front().source),
        legend_box(kDateFieldStyles[0]), legend_box(kDateFieldStyles[1]), legend_box(kDateFieldStyles[2]));
  }
  html += "</div>\n<h3>The three kinds of attention in this model</h3>\n<dl>\n"
          "<dt><b>encoder self-attention</b></dt><dd>Each source character (row) looks at the source characters "
          "(columns), itself included. This is how the encoder works out what a character means in its context: "
          "that a &ldquo;2&rdquo; belongs to a two-digit year, or which word is the month.</dd>\n"
          "<dt><b>decoder masked self-attention</b></dt><dd>Each step of the decoder looks at the answer written so "
          "far: rows and columns are both the decoder's inputs (<code>^</code> and the characters written). It "
          "cannot look ahead, because the characters to its right are not written yet when it writes, so the "
          "upper-right triangle of these maps is blank: those weights are exactly 0 (the mask). This is how the "
          "decoder keeps track of where it is in yyyy-mm-dd.</dd>\n"
          "<dt><b>encoder-decoder attention</b></dt><dd>Each step of the decoder (row) reads the source (columns): "
          "queries come from the decoder, keys and values from the encoder's output. This is where the answer's "
          "characters come from: to write the month the decoder should read the month in the source, whether it is "
          "written 03, 3, Mar or March.</dd>\n</dl>\n";
  html += fmt::format(
      "<h3>How to read a map</h3>\n<p>Rows are queries, columns are keys; each row's weights sum to 1, and darker "
      "blue is more weight (white 0, dark blue 1). <code>^</code> is the start token the decoder begins with, "
      "<code>_</code> a space. A decoder row is labelled with the character the decoder last wrote, and it is the "
      "step that writes the <i>next</i> character: row <code>^</code> writes the year's first digit, the row "
      "labelled with the year's last digit writes the dash.</p>\n"
      "<p id=\"legend\"><b>What to look for.</b> On the encoder-decoder maps, outlined boxes mark where the rows "
      "that write a field meet the source characters that hold it. {}: the four rows that write the year &times; "
      "the year's characters in the source; {}: the two rows that write the month &times; the month's characters "
      "(digits, abbreviation or name); {}: the two rows that write the day &times; the day's characters (digits or "
      "word). A head that has learned to read the fields puts its dark cells inside the boxes. A weekday is no "
      "field (the date determines it), so nothing in the answer needs it. Under each example the head with the "
      "most weight inside the boxes is named, and its map has a black border.</p>\n",
      legend_box(kDateFieldStyles[0]), legend_box(kDateFieldStyles[1]), legend_box(kDateFieldStyles[2]));
  return html;
}

// One line per kind of attention, under its heading.
std::string kind_note(const std::string& slug) {
  if (slug == "encoder_self") return "Rows and columns: the source's characters.";
  if (slug == "decoder_self")
    return "Rows and columns: the decoder's inputs; the blank upper-right triangle is the mask.";
  return "Rows: the decoder's steps; columns: the source's characters; boxes: where each field is read from.";
}

// Which head reads the fields, in numbers from this run, then every map of the example.
std::string example_section(const ExampleMaps& e) {
  std::string html = fmt::format("<h3>&ldquo;{}&rdquo; &rarr; {} ({})</h3>\n", xml_escape(e.source),
                                 xml_escape(e.predicted), e.predicted == e.target ? "correct" : "expected " + e.target);
  const HeadShare best = e.best();
  html += fmt::format(
      "<p class=\"finding\">In the encoder-decoder attention, <b>layer {} head {}</b> puts <b>{}</b> of the weight "
      "of the rows that write the year, month and day on those fields' characters in the source (boxed); a head "
      "spreading its weight evenly would put {} there.",
      best.layer, best.head, percent(best.share), percent(e.even_share));
  if (e.fields.year.size() == 2)
    html += " This source writes the year in two digits, so the century is in no source character: the rows "
            "that write it must read something else.";
  html += " Every head:";
  for (std::size_t i = 0; i < e.cross_shares.size(); ++i)
    html += fmt::format("{} layer {} head {} {}", i == 0 ? "" : ",", e.cross_shares[i].layer, e.cross_shares[i].head,
                        percent(e.cross_shares[i].share));
  html += ".</p>\n";
  for (const KindMaps& kind : e.kinds) {
    html += fmt::format("<h4>{}</h4>\n<p>{}</p>\n<table>\n", kind.name, kind_note(kind.slug));
    for (const auto& heads : kind.layers) {
      html += "<tr>";
      for (const MapFigure& f : heads) {
        html += fmt::format("<td class=\"maps{}\" style=\"width:{}%\"><img src=\"{}\" alt=\"{}\" title=\"{}\">",
                            f.best ? " best" : "", 100 / heads.size(), f.file, xml_escape(f.caption),
                            xml_escape(f.caption));
        if (f.best) html += fmt::format("<p>&uarr; reads the fields best: {} in the boxes</p>", percent(best.share));
        html += "</td>";
      }
      html += "</tr>\n";
    }
    html += "</table>\n";
  }
  return html;
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

const char* kv_cache_label(mha::KVStorage storage) {
  switch (storage) {
    case mha::KVStorage::Int8: return "int8";
    case mha::KVStorage::Float8E4M3: return "fp8";
    case mha::KVStorage::Native: break;
  }
  return "float32";
}

std::string kl_text(double kl) { return kl == 0.0 ? std::string("0") : fmt::format("{:.3g}", kl); }

std::string minutes(double seconds) {
  const auto s = static_cast<long>(std::lround(seconds));
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

HeadShare ExampleMaps::best() const {
  if (cross_shares.empty()) throw std::logic_error("ExampleMaps::best: no encoder-decoder heads");
  return *std::max_element(cross_shares.begin(), cross_shares.end(),
                           [](const HeadShare& a, const HeadShare& b) { return a.share < b.share; });
}

void write_index(const std::filesystem::path& path, const DemoReport& r) {
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>mha demo: a Transformer that reads dates</title>\n"
      "{}</head>\n<body>\n<h1>A Transformer that reads dates</h1>\n"
      "<p>The encoder-decoder Transformer of &ldquo;Attention Is All You Need&rdquo; (section 3), built on "
      "<code>mha::MultiHeadAttention</code>, trained from scratch to rewrite human-written dates as ISO 8601 "
      "(year-month-day, 2021-03-05), one character at a time. Held-out dates were never seen in training, in any "
      "format.</p>\n",
      kStyle);
  html += result_section(r) + formats_section(r.evaluation) + range_section(r) + variations_section(r.variations) +
          mistakes_section(r.evaluation) + explanation_section(r);
  for (const ExampleMaps& e : r.examples) html += example_section(e);
  html += "<p>The checkpoint is <code>checkpoint.safetensors</code>; try <code>mha translate \"Friday, 5 March "
          "2021\"</code>.</p>\n</body></html>\n";
  write_text(path, html);
}

void write_summary(const std::filesystem::path& path, const DemoReport& r) {
  const DemoOptions& o = r.options;
  const Evaluation& ev = r.evaluation;
  nlohmann::json j;
  j["heads"] = o.heads;
  j["d_model"] = o.d_model;
  j["layers"] = o.layers;
  j["steps"] = o.steps;
  j["batch_size"] = o.batch_size;
  j["seed"] = o.seed;
  j["dtype"] = o.dtype;
  j["train_seconds"] = r.training.seconds;
  if (r.float32)
    j["float32_run"] = {{"train_seconds", r.float32->seconds},
                        {"target_tokens_per_second", r.float32->tokens_per_second},
                        {"held_out_exact_match", r.float32->accuracy},
                        {"checkpoint_float32_exact_match", r.float32->checkpoint_accuracy}};
  j["held_out_examples"] = r.eval_count;
  j["held_out_exact_match"] = ev.accuracy;
  j["decode_seconds_cached"] = ev.cached_seconds;
  j["decode_seconds_recomputed"] = ev.full_seconds;
  j["decode_same_outputs"] = ev.same_outputs;
  j["beam_search"] = nlohmann::json::array();
  for (const BeamEvaluation& b : ev.beams)
    j["beam_search"].push_back({{"beams", b.beams},
                                {"held_out_exact_match", b.accuracy},
                                {"decode_seconds", b.seconds},
                                {"differs_from_greedy", b.differs_from_greedy}});
  for (const tf::KVCacheEvaluation& c : ev.caches)
    j["kv_caches"].push_back({{"kv_cache", kv_cache_label(c.storage)},
                              {"beams", ev.cache_widths},
                              {"held_out_exact_match", c.exact_match},
                              {"mean_kl", c.mean_kl},
                              {"decode_seconds", c.seconds}});
  for (const VariationResult& v : r.variations)
    j["variations"].push_back({{"name", v.name},
                               {"example", v.example},
                               {"trained", v.trained},
                               {"right", v.right},
                               {"unsure", v.unsure},
                               {"confidently_wrong", v.confidently_wrong},
                               {"total", v.total}});
  for (const OutsideAnswer& a : r.outside)
    j["outside_range"].push_back({{"input", a.input}, {"line", a.line}, {"marked", a.marked}});
  for (const ExampleMaps& e : r.examples) {
    nlohmann::json m = {{"source", e.source}, {"predicted", e.predicted}, {"even_share", e.even_share}};
    for (const auto& [name, span] :
         {std::pair{"year", e.fields.year}, {"month", e.fields.month}, {"day", e.fields.day}})
      m["fields"][name] = {span.begin, span.end};
    for (const HeadShare& s : e.cross_shares)
      m["cross_shares"].push_back({{"layer", s.layer}, {"head", s.head}, {"share", s.share}});
    j["maps"].push_back(m);
  }
  for (const auto& p : r.training.curve)
    j["curve"].push_back({{"step", p.step}, {"loss", p.loss}, {"accuracy", p.accuracy}, {"seconds", p.seconds}});
  write_text(path, j.dump(2) + "\n");
}

}  // namespace mha_cli
