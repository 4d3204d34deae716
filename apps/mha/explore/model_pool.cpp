// The pool of model copies (model_pool.hpp).
#include "explore/model_pool.hpp"

#include <stdexcept>

#include "transformer/checkpoint.hpp"

namespace mha_cli::explore {

ModelPool::ModelPool(const std::string& checkpoint, std::size_t copies) : copies_(copies) {
  if (copies == 0) throw std::invalid_argument("ModelPool: at least one copy");
  for (std::size_t i = 0; i < copies; ++i) {
    transformer::Checkpoint loaded = transformer::load_checkpoint(checkpoint);
    if (i == 0) {
      metadata_ = loaded.metadata;
      const transformer::TransformerConfig& c = loaded.model->config();
      shape_ = {c.encoder_layers, c.decoder_layers, c.heads};
    }
    idle_.push_back(std::move(loaded.model));
  }
}

ModelPool::Lease ModelPool::lease() {
  std::unique_lock lock(mutex_);
  returned_.wait(lock, [&] { return !idle_.empty(); });
  std::unique_ptr<transformer::Transformer<float>> model = std::move(idle_.back());
  idle_.pop_back();
  return Lease(*this, std::move(model));
}

ModelPool::Lease::~Lease() {
  if (!model_) return;  // moved from
  model_->clear_head_gates();
  model_->keep_attention_weights(false);
  {
    std::lock_guard lock(pool_->mutex_);
    pool_->idle_.push_back(std::move(model_));
  }
  pool_->returned_.notify_one();
}

}  // namespace mha_cli::explore
