// Held-out accuracies by head set, computed once: a bounded, thread-safe cache (least recently used
// out first). Requests for a set whose accuracy is being computed wait for that computation instead
// of starting their own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <string>

namespace mha_cli::explore {

struct HeldOutAccuracy {
  std::size_t correct = 0, examples = 0;
  double accuracy() const { return examples ? static_cast<double>(correct) / static_cast<double>(examples) : 0.0; }
};

class AccuracyCache {
 public:
  explicit AccuracyCache(std::size_t capacity) : capacity_(capacity) {}

  // The accuracy stored under `key`, or compute() run now (on this thread) and stored; `cached` says
  // which. A compute() that throws stores nothing, and its exception reaches every caller waiting on it.
  HeldOutAccuracy get(const std::string& key, const std::function<HeldOutAccuracy()>& compute, bool& cached);

  std::size_t size() const;

 private:
  struct Entry {
    std::shared_future<HeldOutAccuracy> value;
    std::list<std::string>::iterator recency;  // its place in recency_
    std::uint64_t id;                          // which computation made it (keys may come back)
  };
  void forget(const std::string& key);  // caller holds mutex_

  mutable std::mutex mutex_;
  std::size_t capacity_;
  std::map<std::string, Entry> entries_;
  std::list<std::string> recency_;  // most recently used first
  std::uint64_t next_id_ = 0;
};

}  // namespace mha_cli::explore
