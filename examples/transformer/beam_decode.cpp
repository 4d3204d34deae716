// Transformer<T>::beam_decode (transformer.hpp): the decoder run for BeamSearch's slots, its
// self-attention caches in mha::PagedKVCache (forked for the beams that survive, released for the others);
// and Transformer<T>::forced_decode, the same decoder and caches fed the given tokens (teacher forcing).
//
// Legend: B sources, K beams per source, S source positions, V vocabulary, d = d_model, P page size.
#include <algorithm>
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

  std::vector<mha::PagedKVCache>& layers() { return layers_; }

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

void check_page_size(const BeamOptions& o, const char* caller) {
  if (o.page_size < 1)
    throw std::invalid_argument(std::string(caller) + ": page_size must be at least 1, got " +
                                std::to_string(o.page_size));
}

}  // namespace

// Layer `layer`'s self-attention cache for `sequences` sequences of at most o.steps positions, stored as
// o.kv_storage says. Before step t's append, the sequences hold at most ceil(t / P) pages each (shared
// pages counted once); the append takes at most one more page per sequence (a new page, or a copy of a
// shared last page, which forward_paged counts before it appends). So sequences * (ceil(steps / P) + 1)
// pages always do.
template <class T>
mha::PagedKVCacheConfig Transformer<T>::self_cache_config(std::size_t layer, const BeamOptions& o,
                                                          std::int64_t sequences) {
  const std::int64_t pages = sequences * ((o.steps + o.page_size - 1) / o.page_size + 1);
  mha::PagedKVCacheConfig c = decoder_[layer]->self_attention().paged_cache_config(o.page_size, pages * o.page_size);
  if (o.kv_storage != mha::KVStorage::Native && c.dtype != mha::DType::Float32)
    throw std::invalid_argument(std::string("kv_storage ") + mha::kv_storage_name(o.kv_storage) +
                                " needs a model that computes in float32; this one computes in " +
                                mha::dtype_name(c.dtype));
  c.storage = o.kv_storage;
  return c;
}

// One decoder position over the paged self-attention caches: tokens [n], position t of n rows (sequences
// [n], one per row in every layer's cache) -> logits [n, V]. Each row's key and value join its sequence.
template <class T>
Matrix<T> Transformer<T>::paged_step(const std::vector<int>& tokens, std::int64_t t,
                                     std::vector<mha::PagedKVCache>& self, std::span<const SequenceId> sequences,
                                     const std::vector<mha::KeyValueCache>& cross, std::int64_t B,
                                     const std::vector<std::int64_t>& source_lengths) {
  Matrix<T> y = embedding_.embed(tokens);  // [n, d]
  add_positional_encoding(y, 1, t);
  for (std::size_t i = 0; i < decoder_.size(); ++i)
    y = decoder_[i]->beam_step(y, self[i], sequences, cross[i], B, source_lengths);
  if (decoder_norm_) y = decoder_norm_->forward(y);
  return embedding_.apply_logits(y);
}

template <class T>
std::vector<BeamHypothesis> Transformer<T>::beam_decode(const TokenBatch& source, const BeamOptions& o,
                                                        std::vector<std::vector<BeamHypothesis>>* finished) {
  check_page_size(o, "beam_decode");
  const std::int64_t B = source.batch, K = o.beams, V = config_.vocab;
  BeamSearch search(B, K, o.steps, o.eos);  // checks beams and steps
  LayerCaches self;
  for (std::size_t i = 0; i < decoder_.size(); ++i) self.add_layer(self_cache_config(i, o, B * K));
  const bool was_training = training_;
  train(false);
  const Matrix<T> memory = encode(source);  // [B*S, d]
  std::vector<mha::KeyValueCache> cross(decoder_.size());
  for (std::size_t i = 0; i < decoder_.size(); ++i) decoder_[i]->project_memory(cross[i], memory, B);
  std::vector<SequenceId> sequences;  // [B*K]: slot j's sequence
  for (std::int64_t j = 0; j < B * K; ++j) sequences.push_back(self.add_sequence());

  // Step t: the decoder on position t of every slot, then the search keeps the best continuations.
  for (std::int64_t t = 0;; ++t) {
    const Matrix<T> logits = paged_step(search.next_tokens(o.bos, o.bos), t, self.layers(), sequences, cross, B,
                                        source.source_lengths);  // [B*K, V]
    const std::vector<std::int64_t> parent = search.advance(log_softmax_rows<T>(logits.data, V), V);
    if (search.done()) break;
    sequences = self.continue_from(sequences, parent);
  }
  train(was_training);
  if (finished) *finished = search.finished();
  return search.best();
}

template <class T>
std::vector<double> Transformer<T>::forced_decode(const TokenBatch& source, std::span<const int> forced,
                                                  const BeamOptions& o) {
  check_page_size(o, "forced_decode");
  const std::int64_t B = source.batch, n = o.steps, V = config_.vocab;
  if (n < 1) throw std::invalid_argument("forced_decode: steps must be at least 1, got " + std::to_string(n));
  if (static_cast<std::int64_t>(forced.size()) != B * n)
    throw std::invalid_argument("forced_decode: forced must hold B * steps = " + std::to_string(B * n) +
                                " tokens, got " + std::to_string(forced.size()));
  LayerCaches self;
  for (std::size_t i = 0; i < decoder_.size(); ++i) self.add_layer(self_cache_config(i, o, B));
  const bool was_training = training_;
  train(false);
  const Matrix<T> memory = encode(source);  // [B*S, d]
  std::vector<mha::KeyValueCache> cross(decoder_.size());
  for (std::size_t i = 0; i < decoder_.size(); ++i) decoder_[i]->project_memory(cross[i], memory, B);
  std::vector<SequenceId> sequences;  // [B]: source b's sequence
  for (std::int64_t b = 0; b < B; ++b) sequences.push_back(self.add_sequence());

  std::vector<double> out(static_cast<std::size_t>(B * n * V));  // [B, n, V]
  std::vector<int> tokens(static_cast<std::size_t>(B), o.bos);   // [B]: position t's input, y_t (y_0 = <bos>)
  for (std::int64_t t = 0; t < n; ++t) {
    const Matrix<T> logits = paged_step(tokens, t, self.layers(), sequences, cross, B, source.source_lengths);
    const std::vector<double> log_probs = log_softmax_rows<T>(logits.data, V);  // [B, V]
    for (std::int64_t b = 0; b < B; ++b) {
      std::copy_n(log_probs.begin() + b * V, V, out.begin() + (b * n + t) * V);
      tokens[static_cast<std::size_t>(b)] = forced[static_cast<std::size_t>(b * n + t)];
    }
  }
  train(was_training);
  return out;
}

// The class's instantiations are declared extern (transformer.hpp): each member defined here is
// instantiated here.
template mha::PagedKVCacheConfig Transformer<float>::self_cache_config(std::size_t, const BeamOptions&, std::int64_t);
template mha::PagedKVCacheConfig Transformer<double>::self_cache_config(std::size_t, const BeamOptions&, std::int64_t);
template Matrix<float> Transformer<float>::paged_step(const std::vector<int>&, std::int64_t,
                                                      std::vector<mha::PagedKVCache>&, std::span<const SequenceId>,
                                                      const std::vector<mha::KeyValueCache>&, std::int64_t,
                                                      const std::vector<std::int64_t>&);
template Matrix<double> Transformer<double>::paged_step(const std::vector<int>&, std::int64_t,
                                                        std::vector<mha::PagedKVCache>&, std::span<const SequenceId>,
                                                        const std::vector<mha::KeyValueCache>&, std::int64_t,
                                                        const std::vector<std::int64_t>&);
template std::vector<BeamHypothesis> Transformer<float>::beam_decode(const TokenBatch&, const BeamOptions&,
                                                                     std::vector<std::vector<BeamHypothesis>>*);
template std::vector<BeamHypothesis> Transformer<double>::beam_decode(const TokenBatch&, const BeamOptions&,
                                                                      std::vector<std::vector<BeamHypothesis>>*);
template std::vector<double> Transformer<float>::forced_decode(const TokenBatch&, std::span<const int>,
                                                               const BeamOptions&);
template std::vector<double> Transformer<double>::forced_decode(const TokenBatch&, std::span<const int>,
                                                                const BeamOptions&);

}  // namespace transformer
