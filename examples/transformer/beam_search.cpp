// BeamSearch (beam_search.hpp): ranking candidates, finishing hypotheses at <eos>, exact early stopping.
#include "transformer/beam_search.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace transformer {

BeamSearch::BeamSearch(std::int64_t sources, std::int64_t beams, std::int64_t max_steps, int eos)
    : beams_(beams), max_steps_(max_steps), eos_(eos) {
  if (sources < 1 || beams < 1 || max_steps < 1)
    throw std::invalid_argument("BeamSearch: sources (" + std::to_string(sources) + "), beams (" +
                                std::to_string(beams) + ") and max_steps (" + std::to_string(max_steps) +
                                ") must be at least 1");
  live_.resize(static_cast<std::size_t>(sources * beams));
  finished_.resize(static_cast<std::size_t>(sources));
  all_finished_.resize(static_cast<std::size_t>(sources));
  for (std::int64_t b = 0; b < sources; ++b) live_[static_cast<std::size_t>(b * beams)].score = 0.0;
}

std::vector<int> BeamSearch::next_tokens(int first, int filler) const {
  std::vector<int> out;
  for (const BeamHypothesis& h : live_) {
    if (std::isinf(h.score)) out.push_back(filler);
    else out.push_back(h.tokens.empty() ? first : h.tokens.back());
  }
  return out;
}

bool BeamSearch::source_done(std::int64_t b) const {
  const double best_live = live_[static_cast<std::size_t>(b * beams_)].score;  // slot 0 ranks first
  return std::isinf(best_live) || finished_[static_cast<std::size_t>(b)].score >= best_live;
}

bool BeamSearch::done() const {
  if (steps_ >= max_steps_) return true;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(finished_.size()); ++b)
    if (!source_done(b)) return false;
  return true;
}

void BeamSearch::finish(std::int64_t b, const BeamHypothesis& hypothesis) {
  all_finished_[static_cast<std::size_t>(b)].push_back(hypothesis);
  BeamHypothesis& best = finished_[static_cast<std::size_t>(b)];
  if (hypothesis.score > best.score) best = hypothesis;  // strictly: the earlier one wins a tie
}

std::vector<std::int64_t> BeamSearch::advance(std::span<const double> log_probs, std::int64_t vocab) {
  if (done()) throw std::logic_error("BeamSearch::advance: the search is done");
  if (static_cast<std::int64_t>(log_probs.size()) != slots() * vocab)
    throw std::invalid_argument("BeamSearch::advance: expected log_probs [" + std::to_string(slots()) + ", " +
                                std::to_string(vocab) + "], got " + std::to_string(log_probs.size()) + " values");
  std::vector<BeamHypothesis> next(live_.size());  // empty unless filled below
  std::vector<std::int64_t> parent(live_.size());
  for (std::int64_t j = 0; j < slots(); ++j) parent[static_cast<std::size_t>(j)] = j;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(finished_.size()); ++b)
    if (!source_done(b)) advance_source(b, log_probs, vocab, next, parent);
  ++steps_;
  if (steps_ == max_steps_) {  // what is still live has max_steps tokens: finished as it is, best first
    for (std::size_t j = 0; j < next.size(); ++j)
      if (!std::isinf(next[j].score)) finish(static_cast<std::int64_t>(j) / beams_, next[j]);
  }
  live_ = std::move(next);
  return parent;
}

void BeamSearch::advance_source(std::int64_t b, std::span<const double> log_probs, std::int64_t vocab,
                                std::vector<BeamHypothesis>& next, std::vector<std::int64_t>& parent) {
  std::vector<Candidate> candidates;
  for (std::int64_t k = 0; k < beams_; ++k) {
    const std::int64_t slot = b * beams_ + k;
    const double score = live_[static_cast<std::size_t>(slot)].score;
    if (std::isinf(score)) continue;  // an empty slot
    for (std::int64_t v = 0; v < vocab; ++v)
      candidates.push_back({score + log_probs[static_cast<std::size_t>(slot * vocab + v)], slot, static_cast<int>(v)});
  }
  // Higher score first; ties: the better-ranked parent (lower slot), then the lower token id.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& x, const Candidate& y) {
    if (x.score != y.score) return x.score > y.score;
    return x.parent != y.parent ? x.parent < y.parent : x.token < y.token;
  });
  std::int64_t filled = 0;
  for (std::int64_t rank = 0; rank < static_cast<std::int64_t>(candidates.size()) && filled < beams_; ++rank) {
    const Candidate& c = candidates[static_cast<std::size_t>(rank)];
    BeamHypothesis h = live_[static_cast<std::size_t>(c.parent)];
    h.tokens.push_back(c.token);
    h.log_probs.push_back(log_probs[static_cast<std::size_t>(c.parent * vocab + c.token)]);
    h.score = c.score;
    if (c.token == eos_) {
      finish(b, h);
      continue;
    }
    const std::size_t slot = static_cast<std::size_t>(b * beams_ + filled++);
    next[slot] = std::move(h);
    parent[slot] = c.parent;
  }
}

template <class T>
std::vector<double> log_softmax_rows(std::span<const T> logits, std::int64_t vocab) {
  std::vector<double> out(logits.size());
  for (std::size_t row = 0; row < logits.size(); row += static_cast<std::size_t>(vocab)) {
    const std::span<const T> l = logits.subspan(row, static_cast<std::size_t>(vocab));
    const double m = static_cast<double>(*std::max_element(l.begin(), l.end()));
    double sum = 0.0;
    for (const T x : l) sum += std::exp(static_cast<double>(x) - m);
    const double log_normaliser = m + std::log(sum);
    for (std::size_t j = 0; j < l.size(); ++j) out[row + j] = static_cast<double>(l[j]) - log_normaliser;
  }
  return out;
}

template std::vector<double> log_softmax_rows<float>(std::span<const float>, std::int64_t);
template std::vector<double> log_softmax_rows<double>(std::span<const double>, std::int64_t);

}  // namespace transformer
