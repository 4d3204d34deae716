// Transformer<T>::beam_decode (transformer.hpp): the decoder run for BeamSearch's slots, its
// self-attention caches in mha::PagedKVCache (forked for the beams that survive, released for the others).
//
// Legend: B sources, K beams per source, S source positions, V vocabulary, d = d_model, P page size.
#include <stdexcept>
#include <string>
#include <vector>

#include "mha/paged_kv_cache.hpp"
#include "transformer/transformer.hpp"

namespace transformer {
namespace {

using SequenceId = mha::PagedKVCache::SequenceId;

// The decoder's self-attention caches, one mha::PagedKVCache per layer, whose sequences are added,
// forked and released together: a beam's sequence has the same id in every layer's cache.
class LayerCaches {
 public:
  void add_layer(const mha::PagedKVCacheConfig& config) { layers_.emplace_back(config); }
  mha::PagedKVCache& layer(std::size_t i) { return layers_[i]; }

  SequenceId add_sequence() {
    return same_id([](mha::PagedKVCache& c) { return c.add_sequence(); });
  }
  // The sequences of the next step [B*K]: new slot j forks old slot parent[j]'s sequence (sharing its
  // pages), then every old sequence is released (a page goes back to the pool when no fork uses it).
  std::vector<SequenceId> continue_from(const std::vector<SequenceId>& old, const std::vector<std::int64_t>& parent) {
    std::vector<SequenceId> next;
    for (const std::int64_t p : parent) {
      const SequenceId from = old[static_cast<std::size_t>(p)];
      next.push_back(same_id([from](mha::PagedKVCache& c) { return c.fork(from); }));
    }
    for (const SequenceId s : old)
      for (auto& c : layers_) c.release(s);
    return next;
  }

 private:
  // Applies `make` (add_sequence or fork) to every layer's cache; their ids must agree.
  template <class Make>
  SequenceId same_id(Make make) {
    const SequenceId id = make(layers_.front());
    for (std::size_t i = 1; i < layers_.size(); ++i)
      if (make(layers_[i]) != id) throw std::logic_error("beam_decode: the layers' caches gave different sequence ids");
    return id;
  }

  std::vector<mha::PagedKVCache> layers_;
};

}  // namespace

template <class T>
std::vector<BeamHypothesis> Transformer<T>::beam_decode(const TokenBatch& source, const BeamOptions& o,
                                                        std::vector<std::vector<BeamHypothesis>>* finished) {
  if (o.page_size < 1)
    throw std::invalid_argument("beam_decode: page_size must be at least 1, got " + std::to_string(o.page_size));
  const std::int64_t B = source.batch, K = o.beams, V = config_.vocab;
  BeamSearch search(B, K, o.steps, o.eos);  // checks beams and steps
  const bool was_training = training_;
  train(false);
  const Matrix<T> memory = encode(source);  // [B*S, d]

  // Before step t's append, the B*K sequences hold at most ceil(t / P) pages each (shared pages counted
  // once); the append takes at most one more page per sequence (a new page, or a copy of a shared last
  // page, which forward_paged counts before it appends). So B*K*(ceil(steps / P) + 1) pages always do.
  const std::int64_t pages = B * K * ((o.steps + o.page_size - 1) / o.page_size + 1);
  const std::int64_t capacity = pages * o.page_size;
  LayerCaches self;
  std::vector<mha::KeyValueCache> cross(decoder_.size());
  for (std::size_t i = 0; i < decoder_.size(); ++i) {
    self.add_layer(decoder_[i]->self_attention().paged_cache_config(o.page_size, capacity));
    decoder_[i]->project_memory(cross[i], memory, B);
  }
  std::vector<SequenceId> sequences;  // [B*K]: slot j's sequence
  for (std::int64_t j = 0; j < B * K; ++j) sequences.push_back(self.add_sequence());

  // Step t: the decoder on position t of every slot, then the search keeps the best continuations.
  for (std::int64_t t = 0;; ++t) {
    Matrix<T> y = embedding_.embed(search.next_tokens(o.bos, o.bos));  // [B*K, d]
    add_positional_encoding(y, 1, t);
    for (std::size_t i = 0; i < decoder_.size(); ++i)
      y = decoder_[i]->beam_step(y, self.layer(i), sequences, cross[i], B, source.source_lengths);
    if (decoder_norm_) y = decoder_norm_->forward(y);
    const Matrix<T> logits = embedding_.apply_logits(y);  // [B*K, V]
    const std::vector<std::int64_t> parent = search.advance(log_softmax_rows<T>(logits.data, V), V);
    if (search.done()) break;
    sequences = self.continue_from(sequences, parent);
  }
  train(was_training);
  if (finished) *finished = search.finished();
  return search.best();
}

template std::vector<BeamHypothesis> Transformer<float>::beam_decode(const TokenBatch&, const BeamOptions&,
                                                                     std::vector<std::vector<BeamHypothesis>>*);
template std::vector<BeamHypothesis> Transformer<double>::beam_decode(const TokenBatch&, const BeamOptions&,
                                                                      std::vector<std::vector<BeamHypothesis>>*);

}  // namespace transformer
