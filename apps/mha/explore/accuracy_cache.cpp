// The cache of held-out accuracies (accuracy_cache.hpp).
#include "explore/accuracy_cache.hpp"

namespace mha_cli::explore {

HeldOutAccuracy AccuracyCache::get(const std::string& key, const std::function<HeldOutAccuracy()>& compute,
                                   bool& cached) {
  std::promise<HeldOutAccuracy> promise;
  std::shared_future<HeldOutAccuracy> value;
  std::uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    if (const auto it = entries_.find(key); it != entries_.end()) {
      recency_.splice(recency_.begin(), recency_, it->second.recency);
      value = it->second.value;
      cached = true;
    } else {
      value = promise.get_future().share();
      recency_.push_front(key);
      id = next_id_++;
      entries_.emplace(key, Entry{value, recency_.begin(), id});
      while (entries_.size() > capacity_) forget(recency_.back());
      cached = false;
    }
  }
  if (cached) return value.get();  // rethrows a failed computation's exception
  try {
    promise.set_value(compute());
  } catch (...) {
    promise.set_exception(std::current_exception());
    std::lock_guard lock(mutex_);
    if (const auto it = entries_.find(key); it != entries_.end() && it->second.id == id) forget(key);
  }
  return value.get();
}

std::size_t AccuracyCache::size() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

void AccuracyCache::forget(const std::string& key) {
  const auto it = entries_.find(key);
  recency_.erase(it->second.recency);
  entries_.erase(it);
}

}  // namespace mha_cli::explore
