// BeamSearch: the bookkeeping of beam search over a decoder's next-token log-probabilities, apart
// from the model (Transformer::beam_decode runs the decoder and the caches; this decides what to keep).
//
// Legend: B sources, K beams per source, V vocabulary; a slot is one of the B*K rows the decoder runs,
// slot b*K + k holding source b's k-th best live hypothesis (or nothing: an empty slot).
//
// Scoring: the plain sum of the tokens' log-probabilities, log p(y | x) = sum_i log p(y_i | y_<i, x),
// without length normalisation (every answer of the date task has 10 characters and <eos>). Because a
// token's log-probability is <= 0, extending a hypothesis never raises its score; so a source is done
// as soon as its best finished hypothesis scores at least as high as its best live one, and stopping
// there returns what running to the last step would (exact early stopping).
//
// One step, for each source not done: the candidates are every live hypothesis extended by every
// token, ranked by score (higher first), ties by the parent's rank, then by the token id (lower first).
// Walking down the ranking until K candidates are live: one that ends in <eos> is finished (it replaces
// the best finished one if it scores strictly higher: an earlier one wins a tie), the others become
// live; the rest are dropped. With K = 1 this is greedy decoding: the argmax token (the lowest id among
// equals), stopping at <eos>. Hypotheses still live after max_steps tokens are finished as they are.
//
// Tests: tests/transformer/beam_search_test.cpp (K = 1 against greedy decoding, exhaustive search on a
// tiny model, scores recomputed by the full forward).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace transformer {

struct BeamHypothesis {
  std::vector<int> tokens;                                  // y1 .. yn: ends in <eos>, or has max_steps tokens
  std::vector<double> log_probs;                            // [n]: log p(y_i | y_<i, x)
  double score = -std::numeric_limits<double>::infinity();  // sum of log_probs
};

class BeamSearch {
 public:
  // Each source starts with one live hypothesis, the empty one (slot b*K), its other slots empty.
  // Throws std::invalid_argument unless sources >= 1, beams >= 1 and max_steps >= 1.
  BeamSearch(std::int64_t sources, std::int64_t beams, std::int64_t max_steps, int eos);

  std::int64_t slots() const { return static_cast<std::int64_t>(live_.size()); }  // B*K
  // The decoder's next input for every slot [B*K]: each live hypothesis's last token (`first` before
  // any step), `filler` for an empty slot (its output is ignored).
  std::vector<int> next_tokens(int first, int filler) const;

  // One step: log_probs [B*K, V] holds log p(. | slot's hypothesis, x) for every slot (rows of empty
  // slots and of done sources are ignored). Returns the new slots' parents [B*K]: new slot j continues
  // old slot parent[j]'s hypothesis (an empty new slot and every slot of a done source continue
  // themselves, so every slot keeps a sequence). Throws std::logic_error after done().
  std::vector<std::int64_t> advance(std::span<const double> log_probs, std::int64_t vocab);

  bool done() const;  // every source done, or max_steps taken
  // The best finished hypothesis of each source [B] (after done(); before, the best so far).
  const std::vector<BeamHypothesis>& best() const { return finished_; }
  // Every hypothesis that finished, per source [B][...], in the order they finished (the n-best list).
  const std::vector<std::vector<BeamHypothesis>>& finished() const { return all_finished_; }

 private:
  struct Candidate {
    double score;
    std::int64_t parent;  // the old slot
    int token;
  };
  // Source b's candidates, ranked; its new slots [K] and their parents filled from them.
  void advance_source(std::int64_t b, std::span<const double> log_probs, std::int64_t vocab,
                      std::vector<BeamHypothesis>& next, std::vector<std::int64_t>& parent);
  void finish(std::int64_t b, const BeamHypothesis& hypothesis);  // recorded; the best if it beats source b's
  bool source_done(std::int64_t b) const;

  std::int64_t beams_, max_steps_, steps_ = 0;
  int eos_;
  std::vector<BeamHypothesis> live_;                       // [B*K]; an empty slot has score -inf
  std::vector<BeamHypothesis> finished_;                   // [B]: the best finished so far (score -inf: none)
  std::vector<std::vector<BeamHypothesis>> all_finished_;  // [B][...]
};

// log_softmax of each row of logits [rows, V], in double: l_j - (m + log sum_i exp(l_i - m)), m = max.
template <class T>
std::vector<double> log_softmax_rows(std::span<const T> logits, std::int64_t vocab);

}  // namespace transformer
